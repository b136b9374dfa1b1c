"""MEDS penalty, its application to scores, and the order-changed metric, on hand-computed values."""

import math

import numpy as np
import pytest
import torch

from medsrl.algo.advantages import group_advantages
from medsrl.methods.meds.penalty import advantage_order_changed, apply_penalty, meds_penalty, shuffle_penalties


def test_reference_penalty_and_cap():
    # alpha * min(ln(size+1), 2): ln 1 = 0, ln 6 = 1.7918, ln 11 = 2.3979 -> capped at 2
    pen = meds_penalty(np.array([0, 5, 10]), alpha=0.1)
    assert pen == pytest.approx([0.0, 0.1 * math.log(6), 0.2])
    assert meds_penalty([6], alpha=0.02)[0] == pytest.approx(0.02 * math.log(7))  # 0.0389
    assert meds_penalty([7], alpha=0.02)[0] == pytest.approx(0.04)  # ln 8 = 2.079 > 2


def test_explicit_beta():
    assert meds_penalty([5], alpha=0.1, beta=0.15)[0] == pytest.approx(0.15)
    assert meds_penalty([5], alpha=0.1, beta=1.0)[0] == pytest.approx(0.1 * math.log(6))
    assert meds_penalty([100], alpha=0.1, beta=0.2)[0] == pytest.approx(0.2)


def test_negative_size_rejected():
    with pytest.raises(ValueError):
        meds_penalty([-1], alpha=0.1)


SCORES = torch.tensor([1.0, 0.0, 1.0, 0.0, -0.5])
CORRECT = torch.tensor([True, False, True, False, False])
PEN = torch.tensor([0.5, 0.2, 0.25, 0.0, 0.1])


@pytest.mark.parametrize(
    "target, expected",
    [
        ("wrong", [1.0, -0.2, 1.0, 0.0, -0.6]),
        ("right", [1 / 1.5, 0.0, 1 / 1.25, 0.0, -0.5]),
        ("both", [1 / 1.5, -0.2, 1 / 1.25, 0.0, -0.6]),
        ("none", [1.0, 0.0, 1.0, 0.0, -0.5]),
    ],
)
def test_targets(target, expected):
    before = SCORES.clone()
    out = apply_penalty(SCORES, CORRECT, PEN, target)
    assert out.tolist() == pytest.approx(expected)
    assert out is not SCORES and torch.equal(SCORES, before)


def test_default_target_is_wrong():
    assert apply_penalty(SCORES, CORRECT, PEN).tolist() == pytest.approx(
        [1.0, -0.2, 1.0, 0.0, -0.6]
    )


def test_bad_target_and_shapes():
    with pytest.raises(ValueError, match="target"):
        apply_penalty(SCORES, CORRECT, PEN, "wrongs")
    with pytest.raises(ValueError, match="shape"):
        apply_penalty(SCORES, CORRECT, PEN[:3])


def test_order_changed():
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    raw = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    # group 0: tie 0/0 broken -> changed; group 1: constant shift -> same; group 2: singleton
    shaped = torch.tensor([1.0, -0.1, -0.2, -0.1, -0.1, 1.0])
    assert advantage_order_changed(raw, shaped, groups) == pytest.approx(1 / 3)
    flipped = torch.tensor([0.3, 0.5])
    assert advantage_order_changed(torch.tensor([1.0, 0.5]), flipped, torch.tensor([4, 4])) == 1.0
    assert advantage_order_changed(raw, raw.clone(), groups) == 0.0
    assert advantage_order_changed(np.zeros(0), np.zeros(0), np.zeros(0)) == 0.0


def test_constant_penalty_in_a_group_cancels_in_the_advantage():
    groups = torch.tensor([0, 0, 0, 0])
    raw = torch.tensor([1.0, 0.0, 0.0, 1.0])
    correct = raw.bool()
    same = apply_penalty(raw, correct, torch.full((4,), 0.1))  # both wrong get the same penalty
    diff = apply_penalty(raw, correct, torch.tensor([0.0, 0.1, 0.2, 0.0]))
    a_raw, a_same, a_diff = (group_advantages(s, groups) for s in (raw, same, diff))
    assert a_same[1] == pytest.approx(a_same[2]) and a_raw[1] == pytest.approx(a_raw[2])
    assert a_diff[1] > a_diff[2]  # the repeated mistake (bigger cluster) gets less advantage
    assert advantage_order_changed(raw, same, groups) == 0.0
    assert advantage_order_changed(raw, diff, groups) == 1.0


def test_shuffle_penalties_permutes_within_group_and_outcome_the_same_on_any_rank():
    # group "a": wrong rows 0, 1, 3 (penalties .1 .2 .3), right row 2 (.5), featureless wrong row 4
    pen = torch.tensor([0.1, 0.2, 0.5, 0.3, 0.0, 0.7, 0.9])
    groups = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    correct = torch.tensor([False, False, True, False, False, False, False])
    featured = torch.tensor([0, 1, 2, 3, 5, 6])
    out = shuffle_penalties(pen, groups, correct, featured, ["a", "b"], seed=3, step=7)
    assert sorted(out[[0, 1, 3]].tolist()) == pytest.approx([0.1, 0.2, 0.3])
    assert out[2] == pen[2] and out[4] == 0.0  # a lone right row, a featureless row: untouched
    assert sorted(out[5:].tolist()) == pytest.approx([0.7, 0.9])
    assert torch.equal(pen, torch.tensor([0.1, 0.2, 0.5, 0.3, 0.0, 0.7, 0.9]))  # a new tensor
    # group "b" alone on another rank, first in its batch: the same draw
    alone = shuffle_penalties(pen[5:], torch.zeros(2, dtype=torch.long), correct[5:], torch.tensor([0, 1]), ["b"], 3, 7)
    assert torch.equal(alone, out[5:])
