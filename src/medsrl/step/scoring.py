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


def response_logits(
    model,
    packed: PackedRollouts,
    rows: slice | torch.Tensor,
    context: AbstractContextManager | None = None,
) -> torch.Tensor:
    """Logits of the response positions only: ``logits[:, t]`` predicts response token t.

    ``context`` wraps the one forward that runs over the response columns (plug-ins' capture
    hooks are armed there). Two ways, the same logits up to float rounding:

    * shared prompt: rows that repeat the row before's prompt (the ``n`` responses of a group
      are packed next to each other) run the prompt once; its KV cache is expanded to every row
      and the responses run on top of it. The linear layers then see ``G * P + B * R`` tokens
      instead of ``B * (P + R)``: on the tiny preset, half the scoring forward and the update
      (``docs/BENCHMARKS.md``). Gradients flow through the expanded cache into the prompt's
      forward, summed over the group's rows, as in the full forward.
    * full: one forward over prompt and response, when no row shares a prompt, under FSDP's
      wrapper (one forward per unit and backward) or with gradient checkpointing (no cache).

    Either way the rows run without the left-padding columns they all share: a batch is padded
    to its longest prompt, and one long prompt (an R3 reflection prompt quotes a whole response)
    would otherwise widen every micro-batch. Exact: those columns are masked out, and the
    position ids are explicit. (MEDS's capture hooks shift their positions by the columns
    dropped; in the shared way their forward holds the response columns only.)
    """
    P = packed.prompt_length
    resp_len = packed.response_mask.shape[1]
    ids, mask, pos = packed.input_ids[rows], packed.attention_mask[rows], packed.position_ids[rows]
    lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min()) if mask.numel() else 0
    first, group = _prompt_groups(ids[:, :P], mask[:, :P])
    if len(first) == len(ids) or resp_len == 0 or not _can_share_prompts(model):
        with context or nullcontext():
            out = model(
                input_ids=ids[:, lead:], attention_mask=mask[:, lead:], position_ids=pos[:, lead:],
                use_cache=False, logits_to_keep=resp_len + 1,
            )
        return out.logits[:, :-1, :]
    prompt = model(
        input_ids=ids[first, lead:P], attention_mask=mask[first, lead:P], position_ids=pos[first, lead:P],
        use_cache=True, logits_to_keep=1,
    )
    cache = prompt.past_key_values
    cache.reorder_cache(group)  # [G, ...] -> [B, ...]: row i reads its group's prompt
    with context or nullcontext():
        out = model(
            input_ids=ids[:, P:], attention_mask=mask[:, lead:], position_ids=pos[:, P:],
            past_key_values=cache, use_cache=True, logits_to_keep=resp_len,
        )
    return torch.cat([prompt.logits[group], out.logits[:, :-1, :]], dim=1)


def _prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive rows with the same (left-padded) prompt: the first row of each run,
    and each row's run index."""
    new = torch.ones(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    if prompt_ids.shape[0] > 1:
        new[1:] = (prompt_ids[1:] != prompt_ids[:-1]).any(dim=1) | (prompt_mask[1:] != prompt_mask[:-1]).any(dim=1)
    return new.nonzero().squeeze(1), new.long().cumsum(0) - 1


def _can_share_prompts(model) -> bool:
    """Not under FSDP's wrapper (one forward per unit before backward) nor with gradient
    checkpointing (HF drops the cache then)."""
    from medsrl.utils.sharding import is_sharded

    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.2x
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return not is_sharded(model) and not checkpointing


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
                ctx = microbatch_context(start, stop) if microbatch_context else None
                logits = response_logits(model, packed, slice(start, stop), ctx)
                labels = packed.input_ids[start:stop, packed.prompt_length :]
                logps.append(token_logprobs(logits, labels))
                for name, fn in reducers.items():
                    stats[name].append(fn(logits, labels))
                del logits
    finally:
        model.train(was_training)
    return torch.cat(logps), {name: torch.cat(parts) for name, parts in stats.items()}


def scoring_forward_needed(algo, plugins, reducers: dict, engine_logprobs: bool) -> bool:
    """Whether a step must run :func:`scoring_pass` before its update.

    Not when the update is one optimiser step on the freshly sampled rollouts (one PPO epoch,
    one mini-batch) and nothing else reads that forward: no plug-in that reads it
    (``Plugin.reads_scoring_forward``), no token stats, no engine log-probs to compare. The old
    log-probs are then the update's own, detached (ratio 1), as TRL and verl do on-policy; one
    forward over the batch saved (``docs/BENCHMARKS.md``).
    """
    on_policy = algo.ppo_epochs == 1 and algo.mini_batch_prompts is None
    readers = [p for p in plugins if p.reads_scoring_forward]
    return not on_policy or bool(readers or reducers or engine_logprobs)
