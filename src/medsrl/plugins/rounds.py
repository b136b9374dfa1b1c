"""The step's groups through the plug-ins' ``transform_groups``, with DAPO's generation rounds as
an explicit loop (as verl's DAPO trainer): each round passes the plug-ins up to the filter until
the kept groups (over all ranks) fill the batch or ``max_rounds`` extra rounds ran; the surplus is
cut in (round, rank, prompt) order, as one process would; the plug-ins after see the batch once.
"""

from __future__ import annotations

from collections.abc import Callable

from medsrl.plugins.base import Plugin, StepContext
from medsrl.step.rollouts import Group
from medsrl.utils.distributed import all_gather_objects, all_reduce_sum, rank_and_size


def transform(plugins: list[Plugin], groups: list[Group], ctx: StepContext) -> list[Group]:
    """``groups`` through each plug-in's ``transform_groups``, in order."""
    with ctx.timer("groups"):
        for p in plugins:
            groups = p.transform_groups(groups, ctx)
    return groups


def fill_batch(groups: list[Group], sample: Callable[[list, int], list[Group]], datamodule,
               plugins: list[Plugin], ctx: StepContext) -> list[Group]:
    """The batch to train on from the first round's ``groups``. Round ``r``'s extra prompts are
    ``datamodule.extra_prompts(step, r, num_prompts)``; ``sample(prompts, r)`` generates and
    grades this rank's share of them."""
    dapo = next((p for p in plugins if p.max_rounds is not None), None)
    if dapo is None:
        return transform(plugins, groups, ctx)
    at = plugins.index(dapo) + 1  # the plug-ins up to and including the filter, then the rest
    kept_by_round = [transform(plugins[:at], groups, ctx)]
    kept = all_reduce_sum(len(kept_by_round[0]))
    while kept < ctx.num_prompts and len(kept_by_round) <= dapo.max_rounds:
        round_ = len(kept_by_round)
        prompts = datamodule.extra_prompts(ctx.step, round_, ctx.num_prompts)
        kept_by_round.append(transform(plugins[:at], sample(prompts, round_), ctx))
        kept += all_reduce_sum(len(kept_by_round[-1]))
    take = batch_share(all_gather_objects([len(k) for k in kept_by_round]), rank_and_size()[0], ctx.num_prompts)
    dapo.batch_filled(len(kept_by_round) - 1, kept, ctx)
    batch = [g for k, n in zip(kept_by_round, take, strict=True) for g in k[:n]]
    return transform(plugins[at:], batch, ctx)


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
