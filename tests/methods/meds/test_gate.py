"""The gate figures on hand-made groups, and the closed form of MEDS's shaped advantages."""

from __future__ import annotations

import math

import pytest
import torch

from medsrl.algo.advantages import group_advantages
from medsrl.methods.meds.diagnostics import penalty_on_top_answer
from medsrl.methods.meds.gate import (
    closed_form_shaped_advantages,
    common_penalty,
    correct_advantage_loss,
    distinct_penalty_share,
    earlier_answer_counts,
    per_response,
    rewarded_error_share,
    size_recurrence_correlation,
    top_answer_excess,
)


def _random_groups(seed: int, groups: int = 50, n: int = 8):
    """Groups of n 0/1 rewards with both values, and penalties on the wrong responses."""
    g = torch.Generator().manual_seed(seed)
    correct, gids = [], []
    for k in range(groups):
        right = int(torch.randint(1, n, (1,), generator=g))  # 1..n-1 right: a mixed group
        correct += [1.0] * right + [0.0] * (n - right)
        gids += [k] * n
    correct, gids = torch.tensor(correct, dtype=torch.float64), torch.tensor(gids)
    sizes = torch.randint(0, 12, correct.shape, generator=g).double()
    penalty = torch.where(correct > 0, 0.0, 0.1 * torch.log1p(sizes).clamp(max=2.0))
    return correct, penalty, gids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_form_matches_group_normalisation_of_the_shaped_scores(seed):
    correct, penalty, gids = _random_groups(seed)
    shaped = group_advantages(correct - penalty, gids, eps=0.0)
    torch.testing.assert_close(closed_form_shaped_advantages(correct, penalty, gids), shaped, atol=1e-6, rtol=0)


def test_a_shared_wrong_penalty_and_a_single_wrong_response_change_nothing():
    correct = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float64)
    gids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
    raw = group_advantages(correct, gids, eps=0.0)
    # group 0: every wrong response in one cluster of 9 (the paper's "single cluster" ablation);
    # group 1: one wrong response, whatever its penalty
    penalty = torch.tensor([0, 0, 0.23, 0.23, 0.23, 0, 0, 0, 0.2])
    torch.testing.assert_close(group_advantages(correct - penalty, gids, eps=0.0), raw, atol=1e-12, rtol=0)
    assert distinct_penalty_share(gids.tolist(), (correct == 0).tolist(), penalty.tolist()) == 0.0


def test_only_the_spread_of_the_wrong_penalties_moves_advantages():
    correct = torch.tensor([1, 0, 0, 0], dtype=torch.float64)
    gids = torch.zeros(4, dtype=torch.long)
    penalty = torch.tensor([0.0, 0.0, 0.1, 0.2])
    shaped = group_advantages(correct - penalty, gids, eps=0.0)
    assert shaped[1] > shaped[2] > shaped[3]  # the larger cluster loses advantage
    assert distinct_penalty_share([0] * 4, [False, True, True, True], penalty.tolist()) == 1.0


def test_g1_counts_groups_with_two_distinct_wrong_penalties():
    gids = [0, 0, 0, 1, 1, 1, 2, 2]
    wrong = [True, True, False, True, True, False, False, False]
    pen = [0.1, 0.2, 0.0, 0.3, 0.3, 0.0, 0.0, 0.0]
    assert distinct_penalty_share(gids, wrong, pen) == pytest.approx(1 / 3)  # group 0 only
    assert distinct_penalty_share([], [], []) is None


def test_g3_is_the_penalty_share_on_the_top_answer_minus_its_error_share():
    gids = [0, 0, 0, 0, 0]
    wrong = [True, True, True, False, True]
    answers = ["7", "7", "9", "3", "9"]  # top wrong answer: "7" (first seen of the tie), 2 of 4
    assert top_answer_excess(gids, wrong, answers, [0.3, 0.3, 0.1, 0.0, 0.1]) == pytest.approx(0.75 - 0.5)
    assert top_answer_excess(gids, wrong, answers, [0.1, 0.1, 0.3, 0.0, 0.3]) == pytest.approx(0.25 - 0.5)
    assert top_answer_excess(gids, wrong, answers, [0.0] * 5) is None


def test_g4_correlates_size_with_earlier_answer_counts_within_groups():
    history = {"a": {"14": 6, "9": 1}, "b": {"5": 2}}
    counts = earlier_answer_counts(["a", "a", "a", "b", "b", "b"], ["14", "9", "8", "5", None, "6"], history)
    assert counts == [6, 1, 0, 2, 0, 0]
    gids = [0, 0, 0, 1, 1, 1]
    # group 0: sizes follow the counts; group 1: they go against them (ranks 1, 2.5, 2.5)
    corr = size_recurrence_correlation(gids, [7, 3, 2, 1, 4, 4], counts)
    expected = (3 * 1.0 + 3 * -1.0) / 6
    assert corr == pytest.approx(expected)
    assert size_recurrence_correlation([0, 0], [3, 3], [1, 2]) is None  # sizes do not vary
    # the confound a pooled correlation would show: a bigger store, bigger sizes and counts
    assert size_recurrence_correlation([0, 0, 1, 1], [1, 2, 9, 8], [0, 1, 5, 6]) == pytest.approx(0.0)
    assert not math.isnan(size_recurrence_correlation([0, 0, 0], [1, 2, 3], [3, 1, 2]))


def test_g3_is_taken_within_each_group_then_averaged():
    """Two groups whose wrong responses each share one penalty (G1 = 0: MEDS changes nothing):
    within each group the penalty's share on the top answer is that answer's share, G3 = 0. Pooled
    over the groups (v3), the group with the larger penalty and one answer made it +1/3."""
    gids = [0, 1, 1, 1]
    wrong = [True, True, True, True]
    answers = ["7", "5", "6", "8"]
    pen = [0.9, 0.1, 0.1, 0.1]
    assert distinct_penalty_share(gids, wrong, pen) == 0.0
    assert top_answer_excess(gids, wrong, answers, pen) == pytest.approx(0.0)
    on_top, share = penalty_on_top_answer(gids, wrong, answers, pen)  # pooled: (0.9 + 0.1) / 1.2 - 2 / 4
    assert on_top - share == pytest.approx(1.0 / 1.2 - 0.5)
    # two groups that do target: (0.75 - 0.5) and (1/3 - 1/3), averaged
    gids, wrong = [0, 0, 0, 0, 1, 1, 1], [True] * 7
    answers = ["7", "7", "9", "9", "1", "2", "3"]
    pen = [0.3, 0.3, 0.1, 0.1, 0.2, 0.2, 0.2]
    assert top_answer_excess(gids, wrong, answers, pen) == pytest.approx((0.25 + 0.0) / 2)
    assert top_answer_excess([0, 1], [True, True], ["7", "8"], [0.0, 0.0]) is None


def test_g2_common_part_is_the_groups_mean_wrong_penalty_and_changes_no_advantage():
    correct = torch.tensor([1, 0, 0, 1, 1, 0], dtype=torch.float64)
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    penalty = torch.tensor([0.0, 0.1, 0.3, 0.0, 0.0, 0.4], dtype=torch.float64)
    common = common_penalty(penalty, correct == 0, gids)
    torch.testing.assert_close(common, torch.tensor([0.0, 0.2, 0.2, 0.0, 0.0, 0.4], dtype=torch.float64))
    raw = group_advantages(correct, gids, eps=0.0)
    torch.testing.assert_close(group_advantages(correct - common, gids, eps=0.0), raw, atol=1e-12, rtol=0)
    # the targeted part alone moves them: the wrong response with the larger penalty loses
    shaped = group_advantages(correct - penalty, gids, eps=0.0)
    assert shaped[1] > raw[1] > shaped[2]


def test_g5_counts_rewarded_errors_of_mixed_groups_and_g6_the_correct_responses_loss():
    correct = torch.tensor([1, 0, 0, 0, 0], dtype=torch.float64)
    gids = torch.tensor([0, 0, 0, 1, 1])  # group 1: all wrong, no gradient, not counted
    shaped = torch.tensor([0.8, -0.3, 0.05, 0.0, 0.0])
    base = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0])
    assert rewarded_error_share(shaped, correct, gids) == pytest.approx(0.5)
    assert rewarded_error_share(base, correct, gids) == 0.0
    assert correct_advantage_loss(shaped, base, correct, gids) == pytest.approx(1 - 0.8 / 1.0)
    assert rewarded_error_share(shaped[3:], correct[3:], gids[3:]) is None
    assert correct_advantage_loss(shaped[3:], base[3:], correct[3:], gids[3:]) is None
    tokens = torch.tensor([[0.8, 0.8, 0.0], [-0.3, -0.1, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    torch.testing.assert_close(per_response(tokens, mask), torch.tensor([0.8, -0.2]))
