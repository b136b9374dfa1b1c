"""DAPO dynamic sampling: keep only groups whose responses differ in accuracy (or that a plug-in
listed before it made trainable, ``Group.trainable``), and generate extra rounds of prompts
until the step's batch is full again (or ``max_rounds`` is reached). The groups it drops go to
``ctx.dropped`` (MEDS can remember them). The extra rounds' groups
pass through the plug-ins listed before it first, as the first round's did.

Kept groups are counted over all ranks, and the surplus of the last round is cut in
(round, rank, prompt) order, which is the order of one process holding every prompt.
"""

from __future__ import annotations

import logging

from medsrl.plugins.base import Plugin, StepContext
from medsrl.step.rollouts import Group
from medsrl.utils.distributed import all_gather_objects, all_reduce_sum, rank_and_size

log = logging.getLogger(__name__)


class DynamicSampling(Plugin):
    """Drops zero-spread groups; refills the batch from ``datamodule.extra_prompts``."""

    name = "dynamic_sampling"
    reads_scoring_forward = False

    def __init__(self, max_rounds: int = 10) -> None:
        if max_rounds < 0:
            raise ValueError(f"dynamic_sampling.max_rounds must be >= 0, got {max_rounds}")
        self.max_rounds = max_rounds

    def transform_groups(self, groups: list[Group], ctx: StepContext) -> list[Group]:
        target = ctx.num_prompts
        kept_by_round: list[list[Group]] = []
        rounds = 0
        total = 0
        while True:
            kept = [g for g in groups if g.trainable]
            kept_by_round.append(kept)
            ctx.dropped.extend(g for g in groups if not g.trainable)
            total += all_reduce_sum(len(kept))
            if total >= target or rounds >= self.max_rounds:
                break
            rounds += 1
            extra = ctx.trainer.datamodule.extra_prompts(ctx.step, rounds, target)
            groups = ctx.sample(extra, rounds)
        take = batch_share(all_gather_objects([len(k) for k in kept_by_round]), rank_and_size()[0], target)
        chosen = [g for kept, n in zip(kept_by_round, take, strict=True) for g in kept[:n]]
        filled = min(int(total), target)
        if filled < target:
            log.info(
                "step %d: dynamic sampling filled %d/%d groups after %d extra rounds",
                ctx.step, filled, target, rounds,
            )
        ctx.log(self, {
            "extra_rounds": float(rounds),
            "kept_groups": float(filled),
            "batch_fill": filled / max(target, 1),
        })
        return chosen


def batch_share(counts: list[list[int]], rank: int, target: int) -> list[int]:
    """Per round, how many of this rank's kept groups make the batch: the first ``target`` kept
    groups in (round, rank) order. ``counts[q][r]``: groups rank ``q`` kept in round ``r``."""
    budget = target
    mine = []
    for r in range(len(counts[0])):
        for q, per_round in enumerate(counts):
            n = min(per_round[r], max(budget, 0))
            budget -= n
            if q == rank:
                mine.append(n)
    return mine
