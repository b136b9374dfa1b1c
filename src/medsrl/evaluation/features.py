"""MEDS features of evaluation responses, for the diversity metrics.

The same feature as in training (per-layer logit of the first answer token, read by hooks at the
``{`` of the last ``\\boxed{``), computed with one no-grad forward over the packed responses.
Responses without a box get no feature (``None``).
"""

from __future__ import annotations

import torch

from medsrl.rollout.base import RolloutBatch, pack_rollouts
from medsrl.shaping.answer_locator import locate_answers
from medsrl.shaping.logit_capture import LayerLogitCapture, answer_targets


@torch.no_grad()
def response_features(
    policy: torch.nn.Module,
    tokenizer,
    rollout: RolloutBatch,
    *,
    layers=14,
    micro_batch_size: int = 32,
) -> list[list[float] | None]:
    """One feature vector (a list of floats) per response of ``rollout``, or ``None``."""
    if len(rollout) == 0:
        return []
    index = locate_answers(rollout.response_ids, tokenizer)
    if all(i is None for i in index):
        return [None] * len(rollout)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packed = pack_rollouts(rollout.prompt_ids, rollout.response_ids, pad)
    device = next(policy.parameters()).device
    packed = packed.to(device)
    targets = answer_targets(index, rollout.response_ids, packed.prompt_length)
    capture = LayerLogitCapture(policy, layers)
    was_training = policy.training
    policy.eval()
    try:
        for start in range(0, len(rollout), micro_batch_size):
            stop = min(start + micro_batch_size, len(rollout))
            part = targets.for_rows(start, stop)
            if not len(part):
                continue
            with capture.capture(part):
                policy(
                    input_ids=packed.input_ids[start:stop],
                    attention_mask=packed.attention_mask[start:stop],
                    position_ids=packed.position_ids[start:stop],
                    use_cache=False,
                    logits_to_keep=1,
                )
        feats = capture.pop_features().float().cpu()
    finally:
        policy.train(was_training)
    out: list[list[float] | None] = [None] * len(rollout)
    for row, vec in zip(targets.sample_index.tolist(), feats.tolist(), strict=True):
        out[row] = vec
    return out
