"""DAPO's filter (a plug-in) and its refill rounds (a loop of the step, ``PluginHost.fill_batch``), with
generation faked by hand-made groups."""

from __future__ import annotations

from types import SimpleNamespace

from medsrl.data.example import Prompt
from medsrl.methods.dynamic_sampling import DynamicSampling
from medsrl.plugins.base import StepContext
from medsrl.plugins.host import PluginHost, batch_share
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.metrics import PhaseTimer
from medsrl.step.rollouts import Group


def _group(key: str, scores: list[float]) -> Group:
    n = len(scores)
    batch = RolloutBatch([0] * n, [[1]] * n, [[2]] * n, ["r"] * n, ["stop"] * n)
    grades = [GradeResult(s, None, True) for s in scores]
    return Group(Prompt(key, key, key, "1", "t"), batch, grades, ["sampled"] * n)


def _ctx(rounds: dict[int, list[Group]], num_prompts: int):
    asked = []
    dm = SimpleNamespace(extra_prompts=lambda step, r, n: asked.append((step, r, n)) or [f"x{r}"] * n)
    ctx = StepContext(7, "A", PhaseTimer(), num_prompts)
    return ctx, asked, (lambda prompts, r: rounds[r]), dm


def _fill(first: list[Group], max_rounds: int, ctx, sample, dm) -> list[Group]:
    return PluginHost([DynamicSampling(max_rounds=max_rounds)]).fill_batch(first, sample, dm, ctx)


def test_spread_means_both_right_and_wrong():
    assert _group("a", [1, 0, 0]).has_spread
    assert not _group("a", [0, 0, 0]).has_spread and not _group("a", [1, 1]).has_spread


def test_keeps_mixed_groups_and_refills_from_extra_rounds_until_full():
    first = [_group("a", [1, 0]), _group("b", [0, 0]), _group("c", [1, 1]), _group("d", [0, 1])]
    extra = {1: [_group("e", [0, 0]), _group("f", [1, 0])],
             2: [_group("g", [0, 1]), _group("h", [1, 0])]}
    ctx, asked, *gen = _ctx(extra, num_prompts=4)
    kept = _fill(first, 5, ctx, *gen)
    # round 0 keeps a, d; round 1 adds f (3 of 4); round 2 fills the batch with g, h cut off
    assert [g.prompt.key for g in kept] == ["a", "d", "f", "g"]
    assert asked == [(7, 1, 4), (7, 2, 4)]
    assert [g.prompt.key for g in ctx.dropped] == ["b", "c", "e"]  # the surplus h is not dropped
    assert ctx.metrics == {"dynamic_sampling/extra_rounds": 2.0, "dynamic_sampling/kept_groups": 4.0,
                           "dynamic_sampling/batch_fill": 1.0}


def test_stops_after_max_rounds_with_a_partial_batch():
    ctx, asked, *gen = _ctx({1: [_group("e", [0, 0])]}, num_prompts=2)
    kept = _fill([_group("a", [1, 0]), _group("b", [1, 1])], 1, ctx, *gen)
    assert [g.prompt.key for g in kept] == ["a"] and len(asked) == 1
    assert ctx.metrics["dynamic_sampling/batch_fill"] == 0.5


def test_batch_share_cuts_in_round_then_rank_order():
    assert batch_share([[2, 3], [1, 4]], 0, 5) == [2, 2]
    assert batch_share([[2, 3], [1, 4]], 1, 5) == [1, 0]
