"""The forward passes over packed rollouts: response logits, and the one no-grad scoring pass.

The scoring pass computes the old (or reference) log-probs in micro-batches. Plug-ins take part
in the same pass, never a second one: a per-micro-batch context wraps each forward (MEDS arms
its hooks there) and named per-token reducers read each micro-batch's logits while they exist
(token entropy, low-probability statistics), so no ``[B, T, V]`` tensor outlives its micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from medsrl.algo import token_entropy, token_logprobs
from medsrl.algo.logprobs import TokenReducer
from medsrl.rollout.base import PackedRollouts

BUILTIN_REDUCERS: dict[str, TokenReducer] = {
    "entropy": lambda logits, labels: token_entropy(logits),
}


def response_logits(model, packed: PackedRollouts, rows: slice | torch.Tensor) -> torch.Tensor:
    """Logits of the response positions only: ``logits[:, t]`` predicts response token t.

    The rows run without the left-padding columns they all share: a batch is padded to its
    longest prompt, and one long prompt (an R3 reflection prompt quotes a whole response) would
    otherwise widen every micro-batch. Exact: those columns are masked out, and the position ids
    are explicit. (MEDS's capture hooks shift their positions by the columns dropped.)
    """
    resp_len = packed.response_mask.shape[1]
    mask = packed.attention_mask[rows]
    lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min()) if mask.numel() else 0
    out = model(
        input_ids=packed.input_ids[rows][:, lead:],
        attention_mask=mask[:, lead:],
        position_ids=packed.position_ids[rows][:, lead:],
        use_cache=False,
        logits_to_keep=resp_len + 1,
    )
    return out.logits[:, :-1, :]


def scoring_pass(
    model,
    packed: PackedRollouts,
    micro_batch_size: int,
    *,
    reducers: dict[str, TokenReducer] | None = None,
    microbatch_context: Callable[[int, int], AbstractContextManager] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """No-grad log-probs ``[B, R]`` of the response tokens, plus each reducer's ``[B, R]``.

    ``microbatch_context(start, stop)`` wraps the forward of rows ``start:stop``. Values at
    padding positions are whatever the reducer gives there: mask them with the response mask.
    """
    reducers = reducers or {}
    B = packed.input_ids.shape[0]
    logps: list[torch.Tensor] = []
    stats: dict[str, list[torch.Tensor]] = {name: [] for name in reducers}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, B, micro_batch_size):
                stop = min(start + micro_batch_size, B)
                ctx = microbatch_context(start, stop) if microbatch_context else nullcontext()
                with ctx:
                    logits = response_logits(model, packed, slice(start, stop))
                labels = packed.input_ids[start:stop, packed.prompt_length :]
                logps.append(token_logprobs(logits, labels))
                for name, fn in reducers.items():
                    stats[name].append(fn(logits, labels))
                del logits
    finally:
        model.train(was_training)
    return torch.cat(logps), {name: torch.cat(parts) for name, parts in stats.items()}
