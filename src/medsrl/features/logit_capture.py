"""Per-layer answer logits (the MEDS feature, docs/REFERENCE.md step 2): at the answer position, the
LM head on each selected layer's hidden state, the fp32 logit of the next token; layer ``N`` normed
(unless ``tie_last_hidden_states=False``), the others only with ``final_norm``. The hooks, armed only
inside :meth:`LayerLogitCapture.capture`, run inside the forward, where an FSDP-wrapped policy has
its root unit gathered, and keep only those logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DEFAULT_LAST_N = 14


def _is_int(x: Any) -> bool:
    try:
        return not isinstance(x, bool) and int(x) == x
    except (TypeError, ValueError):
        return False


def select_layers(num_layers: int, spec: Any = DEFAULT_LAST_N) -> list[int]:
    """1-based layer indices (``n`` = output of decoder block ``n``), ascending, from ``spec``:
    ``"half"`` (the last ``num_layers // 2``, at least one), ``"all"``, an int-like ``last_n``
    (clipped to ``num_layers``), or a sequence of distinct 1-based indices."""
    last_n = spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        named = {"half": max(1, num_layers // 2), "all": num_layers}
        last_n = named.get(key, int(key) if key.lstrip("+").isdigit() else None)
    if isinstance(last_n, int) and not isinstance(last_n, bool) and last_n >= 1:
        return list(range(num_layers - min(last_n, num_layers) + 1, num_layers + 1))
    layers = list(spec) if hasattr(spec, "__iter__") and not isinstance(spec, str) else []
    if layers and all(map(_is_int, layers)):
        as_ints = sorted(int(x) for x in layers)
        if len(set(as_ints)) == len(as_ints) and 1 <= as_ints[0] and as_ints[-1] <= num_layers:
            return as_ints
    raise ValueError(f"select_layers: {spec!r} is not 'half', 'all', a last n >= 1 or a list of distinct "
                     f"1-based layers in 1..{num_layers} (n = output of decoder block n)")


def _unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP (``.module``), torch.compile (``._orig_mod``) and PEFT wrappers: the hooks go on
    the base model's blocks (FSDP2 keeps the model itself)."""
    from medsrl.models.lora import unwrap_peft

    for _ in range(8):
        if unwrap_peft(model) is not model:
            model = unwrap_peft(model)
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif not hasattr(model, "model") and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            break
    return model


def _missing(model: nn.Module, what: str, expected: str) -> ValueError:
    return ValueError(f"LayerLogitCapture: cannot find the {what} of {type(model).__name__}{expected}")


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM: ``model.model.layers`` (Qwen2, Qwen3, Llama, ...)."""
    model = _unwrap(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    raise _missing(model, "decoder layers", ": expected a causal LM with `model.model.layers` (an "
                   "nn.ModuleList), as in Qwen2 / Qwen3 / Llama")


def find_final_norm(model: nn.Module) -> nn.Module:
    model = _unwrap(model)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if not isinstance(norm, nn.Module):
        raise _missing(model, "final norm", " (expected `model.model.norm`)")
    return norm


def find_lm_head(model: nn.Module) -> nn.Module:
    model = _unwrap(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise _missing(model, "LM head", " (expected `get_output_embeddings()` / `lm_head` with a weight)")
    return head


@dataclass(frozen=True)
class CaptureTargets:
    """Read ``rows[i]`` / ``positions[i]`` of response ``sample_index[i]``, scoring
    ``next_token_ids[i]``; ``seq_len``: the forward's full width (a narrower one dropped left padding)."""

    rows: torch.Tensor
    positions: torch.Tensor
    next_token_ids: torch.Tensor
    sample_index: torch.Tensor
    seq_len: int | None = None

    def __len__(self) -> int:
        return int(self.rows.numel())

    def for_rows(self, rows: Sequence[int] | torch.Tensor, seq_len: int | None = None) -> CaptureTargets:
        """The targets in packed ``rows`` (a micro-batch, any order), made local to it."""
        rows = torch.as_tensor(rows, dtype=torch.long).flatten().to(self.rows.device)
        match = self.rows.unsqueeze(1) == rows.unsqueeze(0)  # [targets, micro-batch rows]
        keep = match.any(dim=1)
        return CaptureTargets(
            rows=match.long().argmax(dim=1)[keep],
            positions=self.positions[keep],
            next_token_ids=self.next_token_ids[keep],
            sample_index=self.sample_index[keep],
            seq_len=self.seq_len if seq_len is None else seq_len,
        )


def answer_targets(
    answer_index: Sequence[int | None],
    response_ids: Sequence[Sequence[int]],
    prompt_length: int,
) -> CaptureTargets:
    """Targets for the located answers of a packed batch: answer ``t`` of response ``i`` reads row
    ``i`` at ``prompt_length + t``, scoring ``response_ids[i][t + 1]``; no answer, or a ``{`` as
    last token: left out."""
    rows, positions, next_ids = [], [], []
    for i, (t, resp) in enumerate(zip(answer_index, response_ids, strict=True)):
        if t is None or not 0 <= int(t) < len(resp) - 1:
            continue
        rows.append(i)
        positions.append(prompt_length + int(t))
        next_ids.append(int(resp[int(t) + 1]))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    width = prompt_length + max((len(r) for r in response_ids), default=0)
    return CaptureTargets(as_long(rows), as_long(positions), as_long(next_ids), as_long(rows), width)


class LayerLogitCapture:
    """Per-layer answer logits of the forward run inside :meth:`capture`; ``token_ids``: keep
    these fixed tokens' logits at every layer (``[M, L * K]``) instead of the next token's."""

    def __init__(self, model: nn.Module, layers: Any = DEFAULT_LAST_N, *, final_norm: bool = False,
                 token_ids: Sequence[int] | None = None):
        self.token_ids = None if token_ids is None else torch.as_tensor(list(token_ids), dtype=torch.long)
        self._blocks = find_decoder_layers(model)
        self.num_layers = len(self._blocks)
        self.layers = select_layers(self.num_layers, layers)
        self.final_norm = bool(final_norm)
        self._norm = find_final_norm(model)
        self._lm_head = find_lm_head(model)
        tie_last = getattr(getattr(_unwrap(model), "config", None), "tie_last_hidden_states", None)
        self.last_layer_normed = True if tie_last is None else bool(tie_last)
        self._entries: list[torch.Tensor] = []  # [m, L] fp32 per capture call
        self.armed = False  # a capture context is open

    def clear(self) -> None:
        self._entries.clear()

    @contextlib.contextmanager
    def capture(self, targets: CaptureTargets) -> Iterator[LayerLogitCapture]:
        """Arm the hooks for the one forward run inside (a second one raises), at ``targets``
        local to its batch; an exception inside discards this call's captures."""
        if self.armed:
            raise RuntimeError("LayerLogitCapture.capture: contexts cannot be nested")
        if not isinstance(targets, CaptureTargets):
            raise TypeError(f"capture: expected CaptureTargets (see answer_targets), got {type(targets).__name__}")
        rows, positions = targets.rows.long(), targets.positions.long()
        store: dict[int, torch.Tensor] = {}
        hooks = {n: self._make_hook(n, rows, positions, targets.next_token_ids, store, targets.seq_len)
                 for n in (self.layers if len(targets) else ())}
        handles = [self._blocks[n - 1].register_forward_hook(hook) for n, hook in hooks.items()]
        self.armed = True
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.armed = False
        if not len(targets):
            self._entries.append(torch.empty(0, self.width, dtype=torch.float32))
            return
        missing = [n for n in self.layers if n not in store]
        if missing:
            raise RuntimeError(f"LayerLogitCapture: layers {missing} did not run inside the capture context; "
                               "run the model forward inside `with cap.capture(...)`")
        self._entries.append(torch.stack([store[n] for n in self.layers], dim=1).flatten(1))  # [m, L(*K)]

    def _make_hook(self, n: int, rows: torch.Tensor, positions: torch.Tensor, next_token_ids: torch.Tensor,
                   store: dict, seq_len: int | None = None):
        normed = self.last_layer_normed if n == self.num_layers else self.final_norm

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if n in store:
                raise RuntimeError(f"LayerLogitCapture: layer {n} ran twice inside one capture context; "
                                   "use one `with cap.capture(...)` per forward")
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            b, s = hidden.shape[0], hidden.shape[1]
            pos = positions if seq_len is None or s >= seq_len else positions - (seq_len - s)
            if int(rows.max()) >= b or int(rows.min()) < 0:
                raise IndexError(f"LayerLogitCapture: rows out of range for batch size {b}")
            if int(pos.max()) >= s or int(pos.min()) < 0:
                raise IndexError(f"LayerLogitCapture: positions out of range for length {s}")
            with torch.no_grad():
                vec = hidden.detach()[rows.to(hidden.device), pos.to(hidden.device)]  # [m, H] copy
                if normed:
                    vec = self._norm(vec)
                store[n] = self._head_logits(vec, next_token_ids)

        return hook

    def _head_logits(self, vec: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """``[m, H]`` vectors -> fp32 logits ``[m]`` of their next tokens, or ``[m, K]`` of the fixed
        ``token_ids``, from only the needed rows of the head."""
        weight, bias = self._lm_head.weight, getattr(self._lm_head, "bias", None)
        vec = vec.to(weight.device).float()
        if self.token_ids is None:
            ids = next_token_ids.to(weight.device, torch.long)
            out = torch.einsum("mlh,mh->ml", vec[:, None], weight.index_select(0, ids).float())[:, 0]
        else:
            ids = self.token_ids.to(weight.device)
            out = vec @ weight.index_select(0, ids).float().T
        return out + bias.index_select(0, ids).float() if isinstance(bias, torch.Tensor) else out

    @property
    def width(self) -> int:
        """Values per captured position: ``L``, or ``L * K`` with fixed ``token_ids``."""
        return len(self.layers) * (1 if self.token_ids is None else len(self.token_ids))

    def features(self) -> torch.Tensor:
        """``[M, L(*K)]`` fp32 logits captured since the last pop."""
        if not self._entries:
            return torch.empty(0, self.width, dtype=torch.float32)
        parts = self._entries
        device = next((p.device for p in parts if p.numel()), parts[0].device)
        return torch.cat([p.to(device) for p in parts], dim=0)

    def pop_features(self) -> torch.Tensor:
        """:meth:`features` (in call order, then target order), then clear the store."""
        out = self.features()
        self.clear()
        return out
