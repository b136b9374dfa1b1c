"""The policy update of one step: PPO epochs x mini-batches (whole groups) x micro-batches. Losses
are aggregated with the mini-batch's global counts, so micro-batches sum to its loss. A non-finite
loss or gradient skips that update on every rank; a runaway one stops the run (``utils/guard.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from medsrl.algo import aggregate_loss, kl_estimate, masked_mean
from medsrl.algo.engine_correction import engine_is_stats
from medsrl.algo.engine_correction import engine_is_weights as weights_of_mode
from medsrl.algo.policy_loss import POLICY_LOSS_STATS, PolicyLossOutput, policy_loss
from medsrl.models.sharding import grad_norm, is_sharded
from medsrl.step.micro_batches import padding_fraction
from medsrl.step.rollouts import SAMPLED, StepRollouts
from medsrl.step.schedule import UpdateSchedule
from medsrl.step.scoring import response_logprobs
from medsrl.utils.guard import RunawayGuard

if TYPE_CHECKING:
    from medsrl.algo.settings import AlgorithmConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateConfig:
    """What the update reads: the algorithm and two run settings."""

    algorithm: AlgorithmConfig
    grad_clip: float  # optim.grad_clip (0: off)
    max_new_tokens: int  # rollout.max_new_tokens: the length normaliser of some loss aggregations

    @cached_property
    def loss(self) -> Callable[..., PolicyLossOutput]:
        return policy_loss(self.algorithm)


def micro_loss(policy, cfg: UpdateConfig, rollouts: StepRollouts, advantages, rows, num_tokens: float, num_seqs: float):
    """The loss of ``rows`` (with grad) and its detached metrics."""
    algo = cfg.algorithm
    packed = rollouts.packed
    # fused LM head + log-softmax: no [b, R, V] logits; entropy differentiable only when it is a loss term
    out = response_logprobs(policy, packed, rows, entropy=True, entropy_grad=algo.entropy_coef > 0)
    logp, entropy = out.logp, out.entropy
    mask = packed.response_mask[rows]
    stats = {k: rollouts.token_stats[k][rows] for k in POLICY_LOSS_STATS.get(algo.policy_loss, {})}
    # no scoring forward (``RLModule.scoring_forward_needed``): on-policy, old = current
    old_logp = logp.detach() if rollouts.old_logp is None else rollouts.old_logp[rows]
    pl = cfg.loss(logp, old_logp, advantages[rows], mask, **stats)
    loss_mat = pl.loss_mat if rollouts.loss_weights is None else pl.loss_mat * rollouts.loss_weights[rows]
    is_stats = {}
    if algo.engine_is_cap is not None:  # the engine sampled from a slightly different policy
        weights = engine_is_weights(rollouts, rows, old_logp, algo.engine_is_cap, algo.engine_is_mode)
        loss_mat = loss_mat * weights
        is_stats = engine_is_stats(weights, mask, algo.engine_is_cap, algo.engine_is_mode)
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=cfg.max_new_tokens)
    loss = aggregate_loss(loss_mat, mask, algo.loss_agg_mode, **agg)
    metrics = {
        "pg_loss": float(loss.detach()),
        "clipfrac": float(pl.clipfrac),
        "clipfrac_low": float(pl.clipfrac_low),
        "clipfrac_high": float(pl.clipfrac_high),
        "dual_clipfrac": float(pl.dual_clipfrac),
        "ppo_kl": float(pl.approx_kl),
        **{f"{algo.policy_loss}/{k}": float(v) for k, v in pl.extra.items()},
        **{f"engine_is/{k}": v for k, v in is_stats.items()},
    }
    metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate_loss(entropy, mask, algo.loss_agg_mode, **agg)
    if rollouts.ref_logp is not None:
        kl = kl_estimate(logp, rollouts.ref_logp[rows], algo.kl_kind)
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
        loss = loss + algo.kl_coef * aggregate_loss(kl, mask, algo.loss_agg_mode, **agg)
    return loss, metrics


def engine_is_weights(rollouts: StepRollouts, rows: torch.Tensor, old_logp: torch.Tensor, cap: float,
                      mode: str = "token_truncate") -> torch.Tensor:
    """IS weights ``[b, R]`` of the sampled rows against the engine's log-probs; 1 on rows a
    plug-in added (R3's replayed rows carry their own importance weights)."""
    if rollouts.engine_logp is None:
        raise ValueError("algorithm.engine_is_cap needs the engine's log-probs: set rollout.logprobs=true")
    mask = rollouts.packed.response_mask[rows]
    weights = weights_of_mode(old_logp, rollouts.engine_logp[rows], mask, cap, mode)
    sampled = torch.tensor([rollouts.source[i] == SAMPLED for i in rows.tolist()], device=weights.device)
    return torch.where(sampled[:, None], weights, torch.ones_like(weights))


# summed over the update's micro-batches (each holds its share of the loss); the others are token
# means: either way the value does not depend on the micro-batch cut
SUMMED_METRICS = ("pg_loss",)


def policy_update(policy, stepper, rollouts: StepRollouts, advantages: torch.Tensor,
                  cfg: UpdateConfig, guard: RunawayGuard) -> dict[str, float]:
    """Run the step's optimiser updates; return the averaged metrics. ``stepper`` (no Lightning
    here): ``zero_grad()``, ``backward(loss)``, ``step(last)`` and ``end_step()`` (returns the lr)."""
    algo, step = cfg.algorithm, rollouts.step
    packed = rollouts.packed
    device = packed.input_ids.device
    advantages = advantages.to(device)
    params = [p for p in policy.parameters() if p.requires_grad]
    sharded = is_sharded(policy)
    index = rollouts.group_index  # the groups' places in the step (step/balance.py), when dealt
    plan = UpdateSchedule.for_this_rank(
        len(rollouts.prompts), per_update=algo.mini_batch_prompts,
        micro_batch_size=algo.micro_batch_size, max_tokens=algo.max_tokens_per_microbatch, sharded=sharded,
        global_index=index if index and None not in index else None,
    )
    prompt_lengths, response_lengths = packed.prompt_lengths, packed.response_lengths
    passes: list[torch.Tensor] = []  # the rows of every real forward/backward, for the padding share
    total_updates = algo.ppo_epochs * len(plan.mini_batches)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    nonfinite = updates_done = 0

    policy.train()
    for _epoch in range(algo.ppo_epochs):
        for groups in plan.mini_batches:
            rows = plan.rows(rollouts.group_ids, groups)
            num_tokens, num_seqs = plan.totals(packed.response_mask[rows])
            stepper.zero_grad()
            bad = False
            shares: dict[str, float] = {}
            for mrows, weight in plan.micro_batches(rows, prompt_lengths, response_lengths):
                mrows = mrows.to(device)
                loss, m = micro_loss(policy, cfg, rollouts, advantages, mrows, num_tokens, num_seqs)
                if weight and not torch.isfinite(loss):
                    bad = True
                    if not sharded:
                        break
                stepper.backward(loss * weight)
                if weight:
                    tokens = float(response_lengths[mrows].sum())
                    passes.append(mrows)
                    for k, v in m.items():
                        if k in SUMMED_METRICS:
                            shares[k] = shares.get(k, 0.0) + v
                        else:
                            sums[k] = sums.get(k, 0.0) + v * tokens
                            counts[k] = counts.get(k, 0) + tokens
            for k, v in shares.items():  # an update's loss, weighted by its rows
                sums[k] = sums.get(k, 0.0) + v * len(rows)
                counts[k] = counts.get(k, 0) + len(rows)
            bad = plan.any_rank(bad)
            if not bad:
                plan.sum_grads(params)
            norm = float("nan") if bad else grad_norm(params, sharded)
            if bad or not math.isfinite(norm):
                nonfinite += 1
                log.warning(
                    "step %d: non-finite %s in update %d/%d; update skipped, weights unchanged",
                    step, "loss" if bad else "gradient", updates_done + 1, total_updates,
                )
                stepper.zero_grad()
            else:
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, torch.tensor(norm))
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm
                counts["grad_norm"] = counts.get("grad_norm", 0) + 1
            updates_done += 1
            stepper.step(last=updates_done == total_updates)  # skips params without grads
            # nothing reads them after the step: freed now, not kept through the next generation
            stepper.zero_grad()
            guard.check(params, sharded, step, f"update {updates_done}/{total_updates}")
    out = {k: sums[k] / counts[k] for k in sums if counts[k]}
    out["padding/update_frac"] = padding_fraction(passes, prompt_lengths, response_lengths)
    out["nonfinite_updates"] = float(nonfinite)
    out["lr"] = stepper.end_step()
    return out
