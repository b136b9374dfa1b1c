"""MEDS features of evaluation responses (the diversity metrics), read as in training, in no-grad
forwards cut like the scoring pass's over the rows with an answer. Under FSDP every rank runs as many
forwards (idle ones where it has fewer rows), so nothing is gathered whole.
"""

from __future__ import annotations

import torch

from medsrl.features.reader import AnswerFeatureReader, FeatureSpec
from medsrl.models.sharding import agreed_passes, idle_forward, is_sharded
from medsrl.rollout.base import RolloutBatch, pack_rollouts
from medsrl.step.micro_batches import plan_micro_batches


@torch.no_grad()
def response_features(
    policy: torch.nn.Module, tokenizer, rollout: RolloutBatch, *, spec: FeatureSpec,
    micro_batch_size: int = 32, max_tokens: int | None = None, reasoning_end: str | None = None,
) -> list[list[float] | None]:
    """One feature vector per response, ``None`` for one without a box (read after ``reasoning_end``)."""
    batches, out = [], [None] * len(rollout)
    if len(rollout):
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        packed = pack_rollouts(rollout.prompt_ids, rollout.response_ids, pad)
        reader = AnswerFeatureReader(policy, tokenizer, spec, reasoning_end)
        reader.begin(rollout.response_ids, packed.prompt_length)
        packed = packed.to(next(policy.parameters()).device)
        batches = plan_micro_batches(reader.answer_rows.to(packed.input_ids.device), packed.prompt_lengths,
                                     packed.response_lengths, max_rows=micro_batch_size, max_tokens=max_tokens)
    passes = agreed_passes(len(batches), is_sharded(policy))
    was_training = policy.training
    policy.eval()
    try:
        for rows in batches:
            start, end = packed.columns_start(rows), packed.columns_end(rows)
            with reader.microbatch(rows, end):
                policy(input_ids=packed.input_ids[rows, start:end],
                       attention_mask=packed.attention_mask[rows, start:end],
                       position_ids=packed.position_ids[rows, start:end], use_cache=False, logits_to_keep=1)
        for _ in range(passes - len(batches)):
            idle_forward(policy)
    finally:
        policy.train(was_training)
    if batches:
        feats, rows = reader.finish()
        for row, vec in zip(rows.tolist(), feats.tolist(), strict=True):
            out[row] = vec
    return out
