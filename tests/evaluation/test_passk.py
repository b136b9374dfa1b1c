"""pass@k against brute force over all k-subsets, its edge cases, and majority voting."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from medsrl.evaluation.passk import (
    answer_key,
    default_ks,
    majority_vote_correct,
    mean_pass_at_k,
    pass_at_k,
)


def brute_force_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_brute_force_for_all_small_cases(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(
                float(brute_force_pass_at_k(n, c, k)), abs=1e-12
            )


def test_edge_cases():
    assert pass_at_k(8, 0, 3) == 0.0  # no correct sample
    assert pass_at_k(8, 8, 3) == 1.0  # all correct
    assert pass_at_k(8, 6, 3) == 1.0  # n-c=2 < k=3: every 3-subset holds a correct one
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 = c/n
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_large_n_is_finite_and_exact():
    # C(1024, 512) ~ 4.5e306 sits at the edge of float range; the product form never forms it
    n, c, k = 1024, 3, 512
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    got = pass_at_k(n, c, k)
    assert math.isfinite(got)
    assert got == pytest.approx(float(exact), rel=1e-12)  # = 1 - (512*511*510)/(1024*1023*1022)


@pytest.mark.parametrize(
    "n, c, k", [(4, -1, 1), (4, 5, 1), (4, 2, 0), (4, 2, 5), (0, 0, 1), (4, 2, -1)]
)
def test_bad_inputs_raise(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_non_integer_count_is_rejected_not_truncated():
    with pytest.raises(TypeError):
        pass_at_k(4, 2.5, 1)
    with pytest.raises(TypeError):
        mean_pass_at_k(4, np.array([1.0, 2.7]), [1])


def test_array_and_mean():
    counts = np.array([0, 1, 4])
    # pass@2 with n=4: c=0 -> 0; c=1 -> 1 - C(3,2)/C(4,2) = 1 - 3/6 = .5; c=4 -> 1
    np.testing.assert_allclose([pass_at_k(4, c, 2) for c in counts], [0.0, 0.5, 1.0])
    means = mean_pass_at_k(4, [0, 1, 4], [1, 2, 4])
    assert means == pytest.approx({1: (0 + 0.25 + 1) / 3, 2: 0.5, 4: 2 / 3})
    assert list(means) == [1, 2, 4]
    with pytest.raises(ValueError):
        mean_pass_at_k(4, [], [1])


def test_default_ks():
    assert default_ks(1) == [1]
    assert default_ks(2) == [1, 2]
    assert default_ks(16) == [1, 2, 4, 8, 16]
    assert default_ks(12) == [1, 2, 4, 8, 12]
    assert default_ks(1023) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1023]
    with pytest.raises(ValueError):
        default_ks(0)


def test_answer_key():
    assert answer_key(" 42\n") == "42"
    assert answer_key(None) is None and answer_key("  ") is None
    assert answer_key("1/2") != answer_key("\\frac{1}{2}")  # no equivalence merging


def test_majority_vote_hand_computed():
    # "3" x2 (wrong) beats "4" x1 (right) and the two unanswered samples
    assert majority_vote_correct(["3", "4", None, " 3", None], [0, 1, 0, 0, 0]) == 0.0
    # "4" x2 (right) beats "3" x1
    assert majority_vote_correct(["4", "3", "4"], [1, 0, 1]) == 1.0
    # 1-1 tie: the first answer seen wins, whichever grade it has
    assert majority_vote_correct(["5", "4"], [0, 1]) == 0.0
    assert majority_vote_correct(["4", "5"], [1, 0]) == 1.0
    # tie on counts 2-2: "7" occurs first
    assert majority_vote_correct(["7", "8", "8", "7"], [1, 0, 0, 1]) == 1.0
    # the group's grade is its first member's
    assert majority_vote_correct(["9", "9"], [0.0, 1.0]) == 0.0
    # equivalent strings split the vote: "0.5" x2 beats "1/2" x1 even if both are right
    assert majority_vote_correct(["1/2", "0.5", "0.5"], [1, 0, 0]) == 0.0


def test_majority_vote_no_answer():
    assert majority_vote_correct([None, None, ""], [0, 0, 0]) == 0.0
    assert majority_vote_correct([], []) == 0.0
    with pytest.raises(ValueError):
        majority_vote_correct(["1"], [1, 0])


def test_cover_at_tau_is_the_share_of_problems_solved_that_reliably():
    from medsrl.evaluation.passk import cover_at

    counts = [0, 1, 4, 8]  # of 8 samples each
    assert cover_at(8, counts, 1 / 8) == pytest.approx(3 / 4)  # solved at all
    assert cover_at(8, counts, 0.5) == pytest.approx(2 / 4)
    assert cover_at(8, counts, 1.0) == pytest.approx(1 / 4)
    assert cover_at([8, 8, 4, 8], [0, 1, 2, 8], 0.5) == pytest.approx(2 / 4)  # each problem its own n
