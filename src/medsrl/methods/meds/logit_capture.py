"""Per-layer answer logits (the MEDS feature) read from the one no-grad forward of a micro-batch.

PAPER.md step 2: at the answer position (the ``{`` of the last ``\\boxed{``, see
:mod:`medsrl.methods.meds.answer_locator`), for each selected layer ``n`` apply the LM head to that
layer's hidden state and keep the raw logit (fp32, no softmax) of the token at ``position + 1``.

Layer numbering and normalisation follow ``output_hidden_states=True`` exactly. With
``hidden_states = model(..., output_hidden_states=True).hidden_states`` (``N + 1`` entries:
index 0 the embeddings, index ``n`` the output of decoder block ``n``), the feature of layer
``n`` (1-based, ``n = 1..N``) is ``lm_head(hidden_states[n])[next_token]``. In transformers 5.x
(``capture_outputs`` with ``tie_last_hidden_states=True``, checked on 5.23 for Qwen2 / Qwen3 /
Llama) ``hidden_states[N]`` is replaced by ``last_hidden_state``, i.e. it *is* passed through the
final norm, while ``hidden_states[1..N-1]`` are raw block outputs. The reference (verl, older
transformers, where the last entry was appended after ``self.norm``) has the same semantics. So:

* layers ``1..N-1``: the raw output of block ``n`` (no final norm), unless ``final_norm=True``,
  which applies ``model.model.norm`` to them too (a textbook logit lens);
* layer ``N``: the output of block ``N`` passed through ``model.model.norm`` (always; unless the
  config sets ``tie_last_hidden_states=False``, which makes HF return it un-normed too).

How it is read: forward hooks on the selected decoder blocks, registered only while a
:meth:`LayerLogitCapture.capture` context is open and removed on exit, so every other forward
(generation, the training forward with grad) runs without hooks and costs nothing. A hook keeps
only the ``M`` vectors at the requested ``(row, position)`` pairs (``M x L x H`` values, never the
full ``B x S x H`` states). On context exit the LM head is applied to those few vectors only, in
fp32, using just the weight rows of the needed tokens:
``logit = h.float() @ W[token].float() (+ b[token])``, and only the ``[m, L]`` logits are kept.

This module is the low-level reader. The MEDS feature itself (which layers to read, the
reference-style first differences, bf16 rounding, one answer per response) is built on it by
:class:`medsrl.methods.meds.features.AnswerFeatureReader`, the one path shared by training and
evaluation. Direct use, in the old-log-prob loop (the step packed once, micro-batches are row
slices)::

    targets = answer_targets(answer_index, response_ids, packed.prompt_length)   # global rows
    cap = LayerLogitCapture(model, layers=14)                                     # last 14
    with torch.no_grad():
        for start in range(0, B, mb):
            stop = min(start + mb, B)
            with cap.capture(targets.for_rows(range(start, stop))):              # local rows
                logits = model(input_ids=packed.input_ids[start:stop], ...)      # the one forward
    feats = cap.pop_features()        # [M, L] fp32, in targets order (= targets.sample_index)

Limitations: the LM head is taken as a plain (possibly biased) linear map; models with logit
scaling or soft-capping would need that added. Sharded LM-head weights (FSDP) must be gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DEFAULT_LAST_N = 14

# --------------------------------------------------------------------------- layer selection


def select_layers(num_layers: int, spec: Any = DEFAULT_LAST_N) -> list[int]:
    """1-based layer indices (``n`` = output of decoder block ``n``, ``1..num_layers``), ascending.

    ``spec``: ``"half"`` (the last ``num_layers // 2``, at least one: 14 of 28), ``"all"``, an
    int-like ``last_n`` (``14`` or ``"14"``; clipped to ``num_layers``), or an explicit sequence of
    1-based layer indices (validated: in range, no duplicates; returned sorted).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"select_layers: num_layers must be a positive int, got {num_layers!r}")
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key == "half":
            last_n = max(1, num_layers // 2)
        elif key == "all":
            last_n = num_layers
        elif key.lstrip("+").isdigit():
            last_n = int(key)
        else:
            raise ValueError(
                f"select_layers: unknown spec {spec!r}; use 'half', 'all', an int (last n) or a "
                f"list of 1-based layer indices"
            )
    elif isinstance(spec, bool):
        raise ValueError(f"select_layers: spec must not be a bool, got {spec!r}")
    elif isinstance(spec, int):
        last_n = spec
    elif isinstance(spec, Sequence) or hasattr(spec, "__iter__"):
        layers = []
        for x in spec:
            if isinstance(x, bool) or not isinstance(x, int):
                try:
                    if isinstance(x, bool) or int(x) != x:
                        raise ValueError
                    x = int(x)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"select_layers: layer indices must be ints, got {x!r} in {spec!r}"
                    ) from None
            layers.append(x)
        if not layers:
            raise ValueError("select_layers: empty layer list")
        bad = [n for n in layers if not 1 <= n <= num_layers]
        if bad:
            raise ValueError(
                f"select_layers: layers {bad} out of range; layers are 1-based, 1..{num_layers} "
                f"(n = output of decoder block n)"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"select_layers: duplicate layers in {list(layers)}")
        return sorted(layers)
    else:
        raise ValueError(f"select_layers: unsupported spec {spec!r}")
    if last_n < 1:
        raise ValueError(f"select_layers: last_n must be >= 1, got {last_n}")
    last_n = min(last_n, num_layers)
    return list(range(num_layers - last_n + 1, num_layers + 1))


# --------------------------------------------------------------------------- model layout


def _unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP / torch.compile / PEFT wrappers (``.module``, ``._orig_mod``, the base model
    of a LoRA policy, whose layers the adapter forward runs through)."""
    from medsrl.models.lora import unwrap_peft

    seen = 0
    while seen < 8:
        seen += 1
        if unwrap_peft(model) is not model:
            model = unwrap_peft(model)
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif (
            not hasattr(model, "model")
            and hasattr(model, "module")
            and isinstance(model.module, nn.Module)
        ):
            model = model.module
        else:
            break
    return model


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM: ``model.model.layers`` (Qwen2, Qwen3, Llama, ...)."""
    model = _unwrap(model)
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    raise ValueError(
        f"LayerLogitCapture: cannot find the decoder layers of {type(model).__name__}: expected "
        f"a causal LM with `model.model.layers` (an nn.ModuleList), as in Qwen2 / Qwen3 / Llama"
    )


def find_final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last decoder block: ``model.model.norm``."""
    model = _unwrap(model)
    norm = getattr(getattr(model, "model", None), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(
            f"LayerLogitCapture: cannot find the final norm of {type(model).__name__} "
            f"(expected `model.model.norm`)"
        )
    return norm


def find_lm_head(model: nn.Module) -> nn.Module:
    model = _unwrap(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"LayerLogitCapture: cannot find the LM head of {type(model).__name__} "
            f"(expected `get_output_embeddings()` / `lm_head` with a weight)"
        )
    return head


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class CaptureTargets:
    """Where to read features: ``rows[i]`` / ``positions[i]`` of the packed batch, scoring
    ``next_token_ids[i]``; ``sample_index[i]`` is the response it belongs to (global row).

    ``seq_len`` is the width the forward would have with every leading column: the packed
    batch's, or a micro-batch's ``columns_end`` when its right padding is not run. A forward
    over fewer columns is taken to have dropped leading (left-padding) columns, as
    ``step.scoring.response_logits`` does per micro-batch, and the positions move left by the
    difference.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    next_token_ids: torch.Tensor
    sample_index: torch.Tensor
    seq_len: int | None = None

    def __len__(self) -> int:
        return int(self.rows.numel())

    def for_rows(self, rows: Sequence[int] | torch.Tensor, seq_len: int | None = None) -> CaptureTargets:
        """The targets in packed ``rows`` (a micro-batch, any order), with rows made local to it:
        row ``rows[j]`` is its row ``j``. ``seq_len``: that forward's full width, when not the
        batch's (its right padding is not run)."""
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
    """Capture targets for located answers in a batch packed by ``pack_rollouts``.

    Response ``i`` with answer token index ``t`` (the ``{``) gives row ``i``, position
    ``prompt_length + t`` and next token ``response_ids[i][t + 1]`` (the first answer token).
    Responses with no answer (``None``) or whose ``{`` is their last token (nothing to score)
    are left out; ``sample_index`` says which responses remain, in ascending order.
    """
    if len(answer_index) != len(response_ids):
        raise ValueError(
            f"answer_targets: {len(answer_index)} answer indices for {len(response_ids)} responses"
        )
    rows, positions, next_ids = [], [], []
    for i, (t, resp) in enumerate(zip(answer_index, response_ids, strict=True)):
        if t is None:
            continue
        t = int(t)
        if t < 0 or t + 1 >= len(resp):
            continue
        rows.append(i)
        positions.append(prompt_length + t)
        next_ids.append(int(resp[t + 1]))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    width = prompt_length + max((len(r) for r in response_ids), default=0)
    return CaptureTargets(as_long(rows), as_long(positions), as_long(next_ids), as_long(rows), width)


# --------------------------------------------------------------------------- capture


class LayerLogitCapture:
    """Capture per-layer answer logits during a forward (see the module docstring).

    ``layers`` is a :func:`select_layers` spec: ``14`` (the last 14), ``"half"``, ``"all"`` or
    a list of 1-based indices. ``final_norm=True`` also passes intermediate layers through the
    final norm (the last layer always is, as in ``output_hidden_states``).

    Each :meth:`capture` context arms hooks for exactly one forward and, on exit, reduces what
    the hooks kept to ``[m, L]`` fp32 logits (the ``[m, L, H]`` vectors are dropped at once);
    :meth:`pop_features` returns everything captured since the last pop, in call order and,
    within a call, in target order.
    """

    def __init__(self, model: nn.Module, layers: Any = DEFAULT_LAST_N, *, final_norm: bool = False):
        self.model = model
        self._blocks = find_decoder_layers(model)
        self.num_layers = len(self._blocks)
        self.layers = select_layers(self.num_layers, layers)
        self.final_norm = bool(final_norm)
        self._norm = find_final_norm(model)
        self._lm_head = find_lm_head(model)
        config = getattr(_unwrap(model), "config", None)
        tie_last = getattr(config, "tie_last_hidden_states", None)
        self.last_layer_normed = True if tie_last is None else bool(tie_last)
        self._entries: list[torch.Tensor] = []  # [m, L] fp32 per capture call
        self._armed = False

    # ------------------------------------------------------------- state

    @property
    def num_features(self) -> int:
        return len(self.layers)

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def num_captured(self) -> int:
        """Number of positions captured since the last pop/clear."""
        return sum(int(e.shape[0]) for e in self._entries)

    def stored_numel(self) -> int:
        """Number of values held: ``M * L`` (only logits are kept between forwards)."""
        return sum(e.numel() for e in self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def _normed(self, n: int) -> bool:
        if n == self.num_layers:
            return self.last_layer_normed
        return self.final_norm

    # ------------------------------------------------------------- capture

    @contextlib.contextmanager
    def capture(self, targets: CaptureTargets) -> Iterator[LayerLogitCapture]:
        """Arm the hooks for the one forward run inside this context.

        ``targets``: :class:`CaptureTargets` with rows local to this forward's batch (see
        :meth:`CaptureTargets.for_rows`). On exit the logits of ``targets.next_token_ids`` are
        computed and only ``[m, L]`` fp32 values are kept.

        Exactly one forward must run inside the context (a second one raises); an exception
        inside it discards this call's captures.
        """
        if self._armed:
            raise RuntimeError("LayerLogitCapture.capture: contexts cannot be nested")
        if not isinstance(targets, CaptureTargets):
            raise TypeError(
                "capture: expected CaptureTargets (see answer_targets), got "
                f"{type(targets).__name__}"
            )
        rows, positions = targets.rows.long(), targets.positions.long()
        m = int(rows.numel())
        store: dict[int, torch.Tensor] = {}
        handles = []
        if m > 0:
            for n in self.layers:
                hook = self._make_hook(n, rows, positions, store, targets.seq_len)
                handles.append(self._blocks[n - 1].register_forward_hook(hook))
        self._armed = True
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._armed = False
        # Only reached when the body raised nothing.
        if m == 0:
            self._entries.append(torch.empty(0, len(self.layers), dtype=torch.float32))
            return
        missing = [n for n in self.layers if n not in store]
        if missing:
            raise RuntimeError(
                f"LayerLogitCapture: layers {missing} did not run inside the capture context; "
                f"run the model forward inside `with cap.capture(...)`"
            )
        hidden = torch.stack([store[n] for n in self.layers], dim=1)  # [m, L, H]
        self._entries.append(self.logits_of(hidden, targets.next_token_ids))

    def _make_hook(self, n: int, rows: torch.Tensor, positions: torch.Tensor, store: dict,
                   seq_len: int | None = None):
        normed = self._normed(n)
        norm = self._norm
        cache: dict[str, torch.Tensor] = {}

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if n in store:
                raise RuntimeError(
                    f"LayerLogitCapture: layer {n} ran twice inside one capture context; use one "
                    f"`with cap.capture(...)` per forward"
                )
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if "rows" not in cache:
                b, s = hidden.shape[0], hidden.shape[1]
                pos = positions if seq_len is None or s >= seq_len else positions - (seq_len - s)
                if rows.numel() and (int(rows.max()) >= b or int(rows.min()) < 0):
                    raise IndexError(f"LayerLogitCapture: rows out of range for batch size {b}")
                if pos.numel() and (int(pos.max()) >= s or int(pos.min()) < 0):
                    raise IndexError(
                        f"LayerLogitCapture: positions out of range for sequence length {s}"
                    )
                cache["rows"] = rows.to(hidden.device)
                cache["positions"] = pos.to(hidden.device)
            with torch.no_grad():
                vec = hidden.detach()[cache["rows"], cache["positions"]]  # [m, H], a copy
                if normed:
                    vec = norm(vec)
            store[n] = vec

        return hook

    # ------------------------------------------------------------- results

    @torch.no_grad()
    def logits_of(self, hidden: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """``[M, L, H]`` hidden vectors -> ``[M, L]`` fp32 logits of ``next_token_ids`` ``[M]``."""
        weight = self._lm_head.weight
        ids = torch.as_tensor(next_token_ids, dtype=torch.long).reshape(-1).to(weight.device)
        if ids.numel() != hidden.shape[0]:
            raise ValueError(
                f"capture: {ids.numel()} next-token ids for {hidden.shape[0]} captured positions"
            )
        if hidden.shape[0] == 0:
            return torch.empty(0, hidden.shape[1], dtype=torch.float32, device=weight.device)
        w = weight.index_select(0, ids).float()  # [M, H]: only the needed rows of the head
        out = torch.einsum("mlh,mh->ml", hidden.to(weight.device).float(), w)
        bias = getattr(self._lm_head, "bias", None)
        if isinstance(bias, torch.Tensor):
            out = out + bias.index_select(0, ids).float()[:, None]
        return out

    def features(self) -> torch.Tensor:
        """``[M, L]`` fp32 logits of everything captured since the last pop (kept stored)."""
        if not self._entries:
            return torch.empty(0, len(self.layers), dtype=torch.float32)
        parts = self._entries
        device = next((p.device for p in parts if p.numel()), parts[0].device)
        return torch.cat([p.to(device) for p in parts], dim=0)

    def pop_features(self) -> torch.Tensor:
        """:meth:`features`, then clear the store."""
        out = self.features()
        self.clear()
        return out
