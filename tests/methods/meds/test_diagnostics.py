"""Whether the penalty lands on the repeated mistake, by hand on small groups."""

from __future__ import annotations

import pytest

from medsrl.methods.meds.diagnostics import cluster_answer_purity, penalty_on_top_answer


def test_cluster_purity_counts_the_majority_answer_of_each_cluster_of_each_group():
    # group 0: cluster 0 holds "14", "14", "11" (2 of 3), cluster 1 holds "7" (1 of 1); group 1:
    # cluster 0 (another prompt's cluster 0) holds "5", "5"; noise and unlabelled are left out
    groups = [0, 0, 0, 0, 0, 1, 1, 1]
    labels = [0, 0, 0, 1, -1, 0, 0, -1]
    answers = ["14", "14", "11", "7", "9", "5", "5", "3"]
    assert cluster_answer_purity(groups, labels, answers) == pytest.approx((2 + 1 + 2) / 6)
    assert cluster_answer_purity([0, 0], [-1, -1], ["1", "2"]) is None
    assert cluster_answer_purity([0, 0], [0, 0], [None, None]) == 1.0  # no answer is one answer


def test_the_penalty_on_the_repeated_mistake_against_its_share_of_the_errors():
    # group 0: wrong answers 14, 14, 11 (top: 14), one right; group 1: wrong 5, 6, 6 (top: 6)
    groups = [0, 0, 0, 0, 1, 1, 1]
    wrong = [True, True, True, False, True, True, True]
    answers = ["14", "14", "11", "2", "5", "6", "6"]
    penalty = [0.3, 0.3, 0.0, 0.0, 0.2, 0.1, 0.1]
    on_top, share = penalty_on_top_answer(groups, wrong, answers, penalty)
    assert on_top == pytest.approx((0.3 + 0.3 + 0.1 + 0.1) / 1.0)
    assert share == pytest.approx(4 / 6)
    # no penalty: no share of it; no wrong response: nothing
    assert penalty_on_top_answer(groups, wrong, answers, [0.0] * 7) == (None, pytest.approx(4 / 6))
    assert penalty_on_top_answer([0], [False], ["1"], [0.0]) == (None, None)
    # a response without an answer is never the top answer
    assert penalty_on_top_answer([0, 0], [True, True], [None, "3"], [1.0, 1.0]) == (0.5, 0.5)
