"""``grader.reward``: a reward function from the config replaces math grading and runs in the
grader's worker processes with the same timeout, counts and logging."""

from __future__ import annotations

import functools

import pytest
from hydra import compose, initialize_config_dir

from custom_rewards import graded, length_share
from medsrl.reward.examples import format_bonus
from medsrl.reward.grader import GradeResult, MathGrader
from medsrl.reward.settings import GraderConfig
from medsrl.run_config import RunConfig
from run_helpers import ROOT


def test_a_custom_reward_runs_in_the_workers_with_its_keywords():
    with MathGrader(num_workers=2, timeout_s=5.0, reward_fn=functools.partial(length_share, scale=2.0)) as grader:
        results = grader.grade_batch(["ab", "abcd \\boxed{4}", ""], ["abcd", "abcd", "ab"])
    assert [r.score for r in results] == [1.0, 2.0, 0.0]  # 2 x 2/4, 2 x min(1, 14/4), 2 x 0
    assert [r.extracted for r in results] == [None, "4", None]  # the last box, for the logs
    assert grader.stats["graded"] == 3 and grader.stats["no_box"] == 2


def test_a_hanging_custom_reward_costs_one_zero_and_the_worker_is_replaced():
    grader = MathGrader(num_workers=1, timeout_s=1.0, reward_fn=length_share)
    try:
        results = grader.grade_batch(["ab", "abcd", "ab"], ["ab", "hang", "abcd"])
        assert [r.score for r in results] == [1.0, 0.0, 0.5]
        assert [r.timed_out for r in results] == [False, True, False]
        assert grader.stats["timeouts"] == 1
        assert grader.grade("abc", "abc").score == 1.0  # the replacement worker grades the next batch
    finally:
        grader.close()


def test_an_exception_or_a_non_number_scores_zero_and_is_counted():
    with MathGrader(num_workers=1, timeout_s=5.0, reward_fn=length_share) as grader:
        boom, text = grader.grade_batch(["x", "x"], ["boom", "text"])
    assert boom.score == 0.0 and "RuntimeError: no reward for you" in boom.error
    assert text.score == 0.0 and "returned 'high', not a number" in text.error
    assert grader.stats["errors"] == 2


def test_a_returned_grade_result_is_kept_as_is():
    with MathGrader(num_workers=0, reward_fn=graded) as grader:
        assert grader.grade("abcdef", "x") == GradeResult(0.5, extracted="abc", has_box=False)


def test_the_format_bonus_example():
    assert format_bonus("so \\boxed{4}", "4") == 1.0
    assert format_bonus("so \\boxed{5}", "4", format_score=0.2) == 0.2
    assert format_bonus("so 4", "4") == 0.0


def test_the_config_builds_the_reward_and_a_bad_target_fails_naming_the_key():
    cfg = GraderConfig(reward={"_target_": "custom_rewards.length_share", "scale": 3.0})
    fn = cfg.reward_function()
    assert fn("ab", "abcd") == 1.5
    assert GraderConfig().reward_function() is None
    with pytest.raises(ValueError, match=r"grader.reward._target_='nowhere.fn' is not an importable function"):
        GraderConfig(reward={"_target_": "nowhere.fn"}).reward_function()


def test_reward_preset_composes_into_grader_reward():
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["reward=format_bonus", "grader.reward.format_score=0.2"])
    run = RunConfig.parse(cfg)
    assert run.grader.reward == {"_target_": "medsrl.reward.examples.format_bonus", "format_score": 0.2}
    assert run.grader.reward_function()("\\boxed{5}", "4") == 0.2
