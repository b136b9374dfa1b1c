"""The overlong penalty as a reward term, and its setting checked at start."""

from __future__ import annotations

from types import SimpleNamespace

from medsrl.data.example import Prompt
from medsrl.methods.overlong import OverlongPenalty
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.step.rollouts import StepRollouts, split_groups
from run_helpers import config_problems


def _module(max_new_tokens):
    return SimpleNamespace(rollout_cfg=SimpleNamespace(max_new_tokens=max_new_tokens))


def test_adds_the_penalty_to_reward_and_scores_as_its_own_term():
    plugin = OverlongPenalty(buffer_length=4, penalty_factor=1.0)
    plugin.setup(None, _module(16), "fit")
    ids = [[0] * 10, [0] * 14, [0] * 16]
    batch = RolloutBatch([0, 0, 0], [[1]] * 3, ids, ["r"] * 3, ["stop", "stop", "length"])
    grades = [GradeResult(s, None, True) for s in (1.0, 0.0, 1.0)]
    groups = split_groups([Prompt("k", "k", "k", "1", "t")], batch, grades)
    r = StepRollouts.from_groups(groups, 0, None, 0, "cpu")
    plugin.shape_rewards(r, None)
    # lengths 10, 14, 16 of 16 with a 4-token buffer from 12: 0, -(14-12)/4, -(16-12)/4
    assert r.terms["overlong"].tolist() == [0.0, -0.5, -1.0]
    assert r.reward.tolist() == [1.0, -0.5, 0.0] and r.scores.tolist() == [1.0, -0.5, 0.0]


def test_a_buffer_as_long_as_the_budget_fails_at_start_naming_the_key():
    overlong = {"_target_": "medsrl.methods.overlong.OverlongPenalty", "buffer_length": 16}
    run = {"rollout": {"max_new_tokens": 16}, "algorithm": {"plugins": {"overlong": overlong}}}
    assert config_problems(run) == [
        "algorithm.plugins.overlong.buffer_length must be less than rollout.max_new_tokens (16), got 16"]
