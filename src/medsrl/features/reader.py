"""The MEDS feature of each response from a forward the caller runs (docs/REFERENCE.md steps 1-2),
for the MEDS plug-in and evaluation alike: the first answer token's per-layer fp32 logits, rounded
to bf16 as the reference's bf16 LM head (HDBSCAN with ``min_samples=1`` treats exact ties apart
from near ones), with ``diff`` as ``logit(n) - logit(n-1)``; ``logits="digits"``: the ten digits'."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import ConfigDict
from torch import nn

from medsrl.features.answer_locator import locate_answers
from medsrl.features.logit_capture import (
    DEFAULT_LAST_N,
    CaptureTargets,
    LayerLogitCapture,
    answer_targets,
    find_decoder_layers,
    select_layers,
)
from medsrl.settings import Flag, Layers, Settings, one_of

FEATURE_DTYPES = ("auto", "float32", "bfloat16")


class FeatureSpec(Settings):
    """What the MEDS feature is made of: ``features`` of the MEDS and novelty plug-ins and of
    evaluation (``medsrl-eval``, ``callbacks.pass_at_k``)."""

    model_config = ConfigDict(frozen=True)

    layers: Layers = DEFAULT_LAST_N
    """The feature's layers: the last N decoder layers, "half", "all" or a list of 1-based layers;
    paper: the last half (14 of 28), the reference script: 14."""
    diff: Flag = False
    """First differences of the per-layer logits, as the reference's option takes them: over all
    layers, then keep the selected."""
    final_norm: Flag = False
    """Apply the final norm to intermediate layers too (logit lens); reference: off."""
    dtype: one_of(FEATURE_DTYPES) = "auto"
    """auto: bf16-rounded when the policy computes in bf16 (the reference applies the LM head under
    bf16 autocast); float32 | bfloat16 to force."""
    logits: one_of(("answer", "digits")) = "answer"
    """answer: the answer token's logit per layer (reference) | digits: the ten digit tokens'
    logits per layer (beyond the reference; study v3's audit)."""


def capture_layers(selected: Sequence[int], diff: bool) -> list[int]:
    """The 1-based layers whose logits must be read: with ``diff`` each selected one's predecessor too."""
    if not diff:
        return sorted(selected)
    return sorted({m for n in selected if n > 1 for m in (n - 1, n)})


def feature_layers(selected: Sequence[int], diff: bool) -> list[int]:
    """The layer of each feature column: with ``diff`` layer 1 has no predecessor and drops out."""
    return sorted(n for n in selected if n > 1 or not diff)


def layer_diffs(logits: torch.Tensor, captured: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """``[M, len(captured)]`` per-layer logits -> ``[M, len(layers)]`` of ``logit(n) - logit(n-1)``."""
    column = {n: i for i, n in enumerate(captured)}
    missing = [n for n in layers if n not in column or n - 1 not in column]
    if missing:
        raise ValueError(f"layer_diffs: layers {missing} or their predecessors were not captured")
    cur = torch.tensor([column[n] for n in layers], dtype=torch.long, device=logits.device)
    prev = torch.tensor([column[n - 1] for n in layers], dtype=torch.long, device=logits.device)
    return logits.index_select(-1, cur) - logits.index_select(-1, prev)


def digit_token_ids(tokenizer: Any) -> list[int]:
    """The ids of ``0`` .. ``9``, each one token (Qwen's BPE and the char tokenizer split digits)."""
    ids = [tokenizer.encode(d, add_special_tokens=False) for d in "0123456789"]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"MEDS features logits=digits: the tokenizer does not give one token per digit ({ids})")
    return [i[0] for i in ids]


def round_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the nearest bf16, kept as fp32: what the reference's bf16 LM head outputs."""
    return x.to(torch.bfloat16).float()


def resolve_feature_dtype(dtype: str, model: nn.Module) -> torch.dtype:
    """``auto``: bf16 when the policy computes in bf16 (bf16 parameters or bf16 autocast), as the reference."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r}; valid: {', '.join(FEATURE_DTYPES)}")
    if dtype != "auto":
        return getattr(torch, dtype)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None:
        return torch.float32
    device = param.device.type
    autocast_bf16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16
    return torch.bfloat16 if param.dtype == torch.bfloat16 or autocast_bf16 else torch.float32


class AnswerFeatureReader:
    """Reads MEDS features from a forward the caller runs (no forward of its own)::

        reader.begin(response_ids, packed.prompt_length)
        for rows in micro_batches:
            with reader.microbatch(rows):
                model(input_ids=packed.input_ids[rows], ...)
        feats, rows = reader.finish()      # [M, D] float32 on CPU, [M] response rows
    """

    def __init__(self, model: nn.Module, tokenizer: Any, spec: FeatureSpec,
                 reasoning_end: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.reasoning_end = reasoning_end  # grader.reasoning_end: the answer is after it
        selected = select_layers(len(find_decoder_layers(model)), spec.layers)
        self.layers = feature_layers(selected, spec.diff)
        if not self.layers:
            raise ValueError(
                f"MEDS features: layers={spec.layers!r} with diff selects only layer 1, which has "
                "no predecessor to difference with; select more layers"
            )
        self.captured_layers = capture_layers(selected, spec.diff)
        self.token_ids = digit_token_ids(tokenizer) if spec.logits == "digits" else None
        self._capture = LayerLogitCapture(model, self.captured_layers, final_norm=spec.final_norm,
                                          token_ids=self.token_ids)
        self._targets: CaptureTargets | None = None
        self._read_rows: list[torch.Tensor] = []

    @property
    def num_features(self) -> int:
        return len(self.layers) * (1 if self.token_ids is None else len(self.token_ids))

    @property
    def dtype(self) -> torch.dtype:
        return resolve_feature_dtype(self.spec.dtype, self.model)

    @property
    def answer_rows(self) -> torch.Tensor:
        """Rows of the current batch that have an answer (ascending)."""
        return self._require_targets("answer_rows").sample_index

    def begin(self, response_ids: Sequence[Sequence[int]], prompt_length: int) -> None:
        """Locate the answers of a packed batch; forget anything read before (a failed step's)."""
        index = locate_answers(response_ids, self.tokenizer, reasoning_end=self.reasoning_end)
        self._targets = answer_targets(index, response_ids, prompt_length)
        self._capture.clear()
        self._read_rows = []

    def microbatch(self, rows: Sequence[int] | torch.Tensor, columns_end: int | None = None
                   ) -> contextlib.AbstractContextManager:
        """Hooks around the one forward of the packed ``rows`` (columns up to ``columns_end``)."""
        part = self._require_targets("microbatch").for_rows(rows, columns_end)
        return self._read(part) if len(part) else contextlib.nullcontext()

    @contextlib.contextmanager
    def _read(self, part: CaptureTargets):
        with self._capture.capture(part):
            yield
        self._read_rows.append(part.sample_index)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features float32 [M, D] on CPU, their rows [M], ascending)``; raises unless the
        micro-batches read each row with an answer exactly once."""
        targets = self._require_targets("finish")
        self._targets = None
        logits = self._capture.pop_features()  # [M, C] fp32, in read order
        parts, self._read_rows = self._read_rows, []
        rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        rows, order = torch.sort(rows)
        if not torch.equal(rows, targets.sample_index):
            raise RuntimeError(f"MEDS features: rows read {rows.tolist()} != rows with an answer "
                               f"{targets.sample_index.tolist()}; run one microbatch(rows) per forward "
                               "over all packed rows")
        logits = logits[order.to(logits.device)]
        if self.dtype == torch.bfloat16:
            logits = round_to_bfloat16(logits)
        if self.spec.diff:
            k = 1 if self.token_ids is None else len(self.token_ids)
            per_token = logits.view(len(logits), len(self.captured_layers), k).transpose(1, 2)  # [M, K, C]
            logits = layer_diffs(per_token, self.captured_layers, self.layers).transpose(1, 2).flatten(1)
        return logits.float().cpu(), rows.long()

    def _require_targets(self, what: str) -> CaptureTargets:
        if self._targets is None:
            raise RuntimeError(f"AnswerFeatureReader.{what}: call begin(...) first")
        return self._targets
