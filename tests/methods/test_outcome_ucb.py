"""The historical outcome bonus (arXiv 2509.06941) over hand-made steps: c / sqrt(1 + N) by hand,
counts after the step, dropped and replayed rows, checkpoints and ranks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from medsrl.data.example import Prompt
from medsrl.methods.outcome_ucb import OutcomeUCB
from medsrl.plugins.base import StepContext
from medsrl.step.metrics import PhaseTimer
from medsrl.step.rollouts import StepRollouts


def _prompt(key: str) -> Prompt:
    return Prompt(key=key, text=f"<{key}>", problem=f"problem {key}", answer="7", source="t")


def _step(step: int, groups: list[tuple[str, list[str | None]]], source: list[str] | None = None) -> StepRollouts:
    """Per group (prompt key, extracted answers); "7" is right."""
    prompts, gids, answers = [], [], []
    for g, (key, given) in enumerate(groups):
        prompts.append(_prompt(key))
        gids += [g] * len(given)
        answers += given
    acc = torch.tensor([1.0 if a == "7" else 0.0 for a in answers])
    return StepRollouts(
        step=step, stage="A", prompts=prompts, group_ids=torch.tensor(gids),
        response_ids=[[0]] * len(acc), response_text=["r"] * len(acc), finish_reason=["stop"] * len(acc),
        grades=[SimpleNamespace(extracted=a) for a in answers], source=source or ["sampled"] * len(acc),
        packed=None, acc=acc, reward=acc.clone(), scores=acc.clone(),
    )


def _ctx(rollouts: StepRollouts, dropped=()) -> StepContext:
    return StepContext(rollouts.step, rollouts.stage, PhaseTimer(), len(rollouts.prompts), dropped=list(dropped))


def _run(plugin: OutcomeUCB, rollouts: StepRollouts, dropped=()) -> torch.Tensor:
    ctx = _ctx(rollouts, dropped)
    plugin.shape_rewards(rollouts, ctx)
    plugin.commit([plugin.step_additions(rollouts, ctx)], ctx)
    return rollouts.scores


def test_bonus_is_c_over_sqrt_one_plus_earlier_count_and_counts_update_after_the_step():
    ucb = OutcomeUCB(c=0.5)
    # step 0: nothing seen yet, every answered response gets c = 0.5; the unanswered one nothing
    s0 = _run(ucb, _step(0, [("k", ["7", "7", "9", None])]))
    torch.testing.assert_close(s0, torch.tensor([1.5, 1.5, 0.5, 0.0]))
    assert ucb.answer_counts == {"k": {"7": 2, "9": 1}}  # right and wrong answers alike
    # step 1: "7" seen twice -> 0.5/sqrt(3) = 0.288675; "9" once -> 0.5/sqrt(2) = 0.353553; "3" new
    r1 = _step(1, [("k", ["7", "9", "3", None]), ("other", ["9"])])
    s1 = _run(ucb, r1)
    expected = torch.tensor([1 + 0.5 / math.sqrt(3), 0.5 / math.sqrt(2), 0.5, 0.0, 0.5])
    torch.testing.assert_close(s1, expected)
    assert 0.5 / math.sqrt(3) == pytest.approx(0.288675, abs=1e-6)
    torch.testing.assert_close(r1.terms["outcome_ucb"], expected - r1.reward)  # a named score term
    torch.testing.assert_close(r1.reward, torch.tensor([1.0, 0, 0, 0, 0]))  # the reward stays raw
    assert ucb.answer_counts == {"k": {"7": 3, "9": 2, "3": 1}, "other": {"9": 1}}


def test_dropped_groups_count_and_replayed_rows_do_not():
    dropped = [SimpleNamespace(prompt=_prompt("k"), grades=[SimpleNamespace(extracted="7")] * 3,
                               source=["sampled"] * 3)]
    ucb = OutcomeUCB(c=1.0)
    _run(ucb, _step(0, [("k", ["9", "7"])], source=["sampled", "r3"]), dropped=dropped)
    assert ucb.answer_counts == {"k": {"9": 1, "7": 3}}  # the replayed "7" not again
    no_dropped = OutcomeUCB(c=1.0, count_dropped=False)
    _run(no_dropped, _step(0, [("k", ["9", "7"])]), dropped=dropped)
    assert no_dropped.answer_counts == {"k": {"9": 1, "7": 1}}
    # c / sqrt(1 + 3) = 0.5 for "7", 1 / sqrt(2) for "9"
    s = _run(ucb, _step(1, [("k", ["7", "9"])]))
    torch.testing.assert_close(s, torch.tensor([1.5, 1 / math.sqrt(2)]))


def test_state_is_checkpointed_and_identical_whatever_the_rank_order(tmp_path):
    a, b = OutcomeUCB(), OutcomeUCB()
    r = _step(0, [("k", ["7", "9"]), ("j", ["2"])])
    rank0 = [("k", "7"), ("k", "9")]
    rank1 = [("j", "2"), ("k", "9")]
    a.commit([rank0, rank1], _ctx(r))
    b.commit([rank1, rank0], _ctx(r))
    assert a.answer_counts == b.answer_counts and a.digest() == b.digest()
    path = tmp_path / "state.pt"
    torch.save(a.state_dict(), path)
    restored = OutcomeUCB()
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.answer_counts == {"k": {"7": 1, "9": 2}, "j": {"2": 1}} and restored.digest() == a.digest()
    # the next step's bonus is the same from the restored state
    torch.testing.assert_close(_run(restored, _step(1, [("k", ["9"])])), _run(a, _step(1, [("k", ["9"])])))
