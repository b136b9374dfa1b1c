"""MEDS features of evaluation responses, for the diversity metrics: the same feature as in
training (``AnswerFeatureReader``), read around one no-grad forward over the packed responses."""

from __future__ import annotations

import torch

from medsrl.methods.meds.features import AnswerFeatureReader, FeatureSpec
from medsrl.rollout.base import RolloutBatch, pack_rollouts


@torch.no_grad()
def response_features(
    policy: torch.nn.Module, tokenizer, rollout: RolloutBatch, *, spec: FeatureSpec,
    micro_batch_size: int = 32, reasoning_end: str | None = None,
) -> list[list[float] | None]:
    """One feature vector (a list of floats) per response of ``rollout``, ``None`` for one without
    a box (``reasoning_end``: the answer is read after it, as the grader reads it)."""
    if len(rollout) == 0:
        return []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packed = pack_rollouts(rollout.prompt_ids, rollout.response_ids, pad)
    reader = AnswerFeatureReader(policy, tokenizer, spec, reasoning_end)
    reader.begin(rollout.response_ids, packed.prompt_length)
    answer_rows = reader.answer_rows
    if not len(answer_rows):
        return [None] * len(rollout)
    packed = packed.to(next(policy.parameters()).device)
    was_training = policy.training
    policy.eval()
    try:
        for start in range(0, len(rollout), micro_batch_size):
            stop = min(start + micro_batch_size, len(rollout))
            if not bool(((answer_rows >= start) & (answer_rows < stop)).any()):
                continue  # no answer in these rows: skip their forward altogether
            with reader.microbatch(range(start, stop)):
                mb = slice(start, stop)
                policy(input_ids=packed.input_ids[mb], attention_mask=packed.attention_mask[mb],
                       position_ids=packed.position_ids[mb], use_cache=False, logits_to_keep=1)
        feats, rows = reader.finish()
    finally:
        policy.train(was_training)
    out: list[list[float] | None] = [None] * len(rollout)
    for row, vec in zip(rows.tolist(), feats.tolist(), strict=True):
        out[row] = vec
    return out
