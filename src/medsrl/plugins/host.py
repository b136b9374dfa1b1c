"""The module's plug-ins, called in order at each point of the step, with DAPO's generation rounds
as an explicit loop (as verl's): rounds pass the plug-ins up to the filter until the kept groups fill
the batch; the surplus is cut in (round, rank, prompt) order, as one process would."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch

from medsrl.plugins.base import Plugin, StepContext
from medsrl.step.rollouts import Group
from medsrl.step.scoring import BUILTIN_REDUCERS, TokenReducer
from medsrl.utils.distributed import all_gather_objects, all_reduce_sum, is_distributed, rank_and_size

log = logging.getLogger(__name__)


class PluginHost:
    """Runs each hook of every plug-in in ``algorithm.plugins`` order."""

    def __init__(self, plugins: list[Plugin]) -> None:
        names = [p.name for p in plugins]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"two plug-ins named {dup}: give each its own key in algorithm.plugins")
        self.plugins = list(plugins)
        self.reducers = self._reducers()

    def _reducers(self) -> dict[str, TokenReducer]:
        out: dict[str, TokenReducer] = {}
        for p in self.plugins:
            own = p.token_reducers()
            for name in p.token_stats:
                if name not in BUILTIN_REDUCERS and name not in own:
                    raise ValueError(
                        f"plug-in {p.name!r} asks for token stat {name!r}; built in: "
                        f"{sorted(BUILTIN_REDUCERS)}, or define it in token_reducers()"
                    )
                out[name] = own.get(name, BUILTIN_REDUCERS.get(name))
            for name, fn in own.items():
                out.setdefault(name, fn)
        return out

    def add_prompts(self, prompts: list, ctx: StepContext) -> list:
        return list(prompts) + [q for p in self.plugins for q in p.add_prompts(prompts, ctx)]

    def fill_batch(self, groups: list[Group], sample: Callable[[list, int], list[Group]], datamodule,
                   ctx: StepContext) -> list[Group]:
        """The batch to train on from the first round's ``groups``; ``sample(prompts, r)`` generates
        and grades this rank's share of round ``r``'s extra prompts."""
        plugins = self.plugins
        dapo = next((p for p in plugins if p.max_rounds is not None), None)
        if dapo is None:
            return _transform(plugins, groups, ctx)
        at = plugins.index(dapo) + 1  # the plug-ins up to and including the filter, then the rest
        kept_by_round = [_transform(plugins[:at], groups, ctx)]
        kept = all_reduce_sum(len(kept_by_round[0]))
        while kept < ctx.num_prompts and len(kept_by_round) <= dapo.max_rounds:
            round_ = len(kept_by_round)
            prompts = datamodule.extra_prompts(ctx.step, round_, ctx.num_prompts)
            kept_by_round.append(_transform(plugins[:at], sample(prompts, round_), ctx))
            kept += all_reduce_sum(len(kept_by_round[-1]))
        counts = all_gather_objects([len(k) for k in kept_by_round])
        take = batch_share(counts, rank_and_size()[0], ctx.num_prompts)
        dapo.batch_filled(len(kept_by_round) - 1, kept, ctx)
        batch = [g for k, n in zip(kept_by_round, take, strict=True) for g in k[:n]]
        return _transform(plugins[at:], batch, ctx)

    def before_scoring(self, rollouts, ctx: StepContext) -> None:
        for p in self.plugins:
            p.before_scoring(rollouts, ctx)

    def microbatch_context(self, rollouts) -> Callable[[torch.Tensor], AbstractContextManager]:
        """Every plug-in's context for the forward of the packed ``rows``, entered only when it runs."""

        @contextmanager
        def enter(rows: torch.Tensor) -> Iterator[None]:
            with ExitStack() as stack:
                for p in self.plugins:
                    stack.enter_context(p.scoring_microbatch(rollouts, rows))
                yield

        return enter

    def after_scoring(self, rollouts, ctx: StepContext) -> None:
        for p in self.plugins:
            p.after_scoring(rollouts, ctx)

    def shape_rewards(self, rollouts, ctx: StepContext) -> None:
        for p in self.plugins:
            p.shape_rewards(rollouts, ctx)

    def commit(self, rollouts, ctx: StepContext) -> None:
        """All-gather every plug-in's additions, commit them in rank order, check the replicas agree."""
        adds = {p.name: p.step_additions(rollouts, ctx) for p in self.plugins}
        gathered = all_gather_objects(adds)
        for p in self.plugins:
            p.commit([g[p.name] for g in gathered], ctx)
        if is_distributed():
            digests = all_gather_objects({p.name: p.digest() for p in self.plugins})
            for p in self.plugins:
                if len({d[p.name] for d in digests}) > 1:
                    raise RuntimeError(f"step {ctx.step}: state of plug-in {p.name!r} differs across ranks")

    def shape_advantages(self, rollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        for p in self.plugins:
            advantages = p.shape_advantages(rollouts, advantages, ctx)
        return advantages


def _transform(plugins: list[Plugin], groups: list[Group], ctx: StepContext) -> list[Group]:
    """``groups`` through each plug-in's ``transform_groups``, in order."""
    with ctx.timer("groups"):
        for p in plugins:
            groups = p.transform_groups(groups, ctx)
    return groups


def batch_share(counts: list[list[int]], rank: int, target: int) -> list[int]:
    """Per round, how many of this rank's kept groups are among the first ``target`` in (round, rank)
    order; ``counts[q][r]``: groups rank ``q`` kept in round ``r``."""
    budget = target
    mine = []
    for r in range(len(counts[0])):
        for q, per_round in enumerate(counts):
            n = min(per_round[r], max(budget, 0))
            budget -= n
            if q == rank:
                mine.append(n)
    return mine
