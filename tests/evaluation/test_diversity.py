"""Distinct answers, feature eigen ratio and wrong-answer clusters on hand-built data."""

import math

import numpy as np
import pytest

from medsrl.evaluation.diversity import (
    DIVERSITY_KEYS,
    distinct_answers,
    distinct_wrong_answers,
    problem_diversity,
    top1_eigen_ratio,
    wrong_cluster_count,
)

E = np.eye(8)


def blob(direction, n, step=0.01):
    """n points evenly spaced along E[7] around ``direction``: one tight cluster that HDBSCAN
    (min_cluster_size=2) cannot split, since all neighbour distances are equal."""
    return np.stack([direction + i * step * E[7] for i in range(n)])


def test_distinct_answers():
    answers = ["3", " 3", "4", None, "", "1/2", "0.5"]
    # "3" (twice, after stripping), "4", "1/2", "0.5"; None and "" are no answer
    assert distinct_answers(answers) == 4
    assert distinct_answers([None, None]) == 0
    assert distinct_answers([]) == 0


def test_distinct_wrong_answers():
    answers = ["3", "3", "4", None, "5", "6"]
    scores = [0, 0, 1, 0, 0.5, 1]
    # wrong and answered: "3", "3", "5" -> 2 distinct; "4", "6" are right, None is no answer
    assert distinct_wrong_answers(answers, scores) == 2
    with pytest.raises(ValueError):
        distinct_wrong_answers(["1"], [])


def test_eigen_ratio_rank_one_vs_isotropic():
    rng = np.random.default_rng(0)
    d = 8
    line = rng.normal(size=(200, 1)) * rng.normal(size=(1, d)) + 3.0  # rank-1 spread
    assert top1_eigen_ratio(line) == pytest.approx(1.0, abs=1e-9)
    iso = rng.normal(size=(20000, d))
    assert top1_eigen_ratio(iso) == pytest.approx(1 / d, abs=0.02)


def test_eigen_ratio_undefined_cases():
    assert math.isnan(top1_eigen_ratio(np.ones((1, 4))))  # one row: no covariance
    assert math.isnan(top1_eigen_ratio(np.ones((5, 4))))  # all equal: zero variance
    assert math.isnan(top1_eigen_ratio(np.zeros((0, 4))))


def test_wrong_cluster_count_two_blobs():
    x = np.vstack([blob(E[0], 6), blob(E[1], 6)])
    assert wrong_cluster_count(x) == 2


def test_wrong_cluster_count_small_and_degenerate():
    assert wrong_cluster_count(np.zeros((0, 4))) == 0
    assert wrong_cluster_count(np.ones((1, 4))) == 1
    # identical errors are one mode (HDBSCAN calls them noise; noise counts as one cluster)
    assert wrong_cluster_count(np.ones((5, 4))) == 1
    assert wrong_cluster_count(np.ones((2, 4))) == 1
    with pytest.raises(ValueError):
        wrong_cluster_count(np.ones(4))


def test_problem_diversity_uses_present_wrong_rows():
    # responses 0-5 wrong in two blobs, 6-7 right (far away), response 8 wrong without a feature
    feats = np.vstack([blob(E[0], 3), blob(E[1], 3), blob(E[2], 2), np.full((1, 8), np.nan)])
    answers = ["1", "1", "1", "2", "2", "2", "7", "7", None]
    scores = [0, 0, 0, 0, 0, 0, 1, 1, 0]
    out = problem_diversity(answers, scores, feats)
    assert tuple(out) == DIVERSITY_KEYS
    assert out["distinct_answers"] == 3.0
    assert out["distinct_wrong"] == 2.0
    assert out["wrong_clusters"] == 2.0  # the right rows and the NaN row are left out
    assert out["eigen_ratio"] == pytest.approx(top1_eigen_ratio(feats[:8]))


def test_problem_diversity_without_features():
    out = problem_diversity(["1", "2"], [0, 1])
    assert out["distinct_answers"] == 2.0 and out["distinct_wrong"] == 1.0
    assert math.isnan(out["eigen_ratio"]) and math.isnan(out["wrong_clusters"])
    with pytest.raises(ValueError):
        problem_diversity(["1", "2"], [0, 1], np.ones((3, 4)))  # rows not aligned with scores


def test_rarefied_distinct_wrong_answers_by_hand():
    from medsrl.evaluation.diversity import rarefied_distinct_wrong

    answers, scores = ["1", "1", "2", "3", "7", None], [0, 0, 0, 0, 1, 0]  # wrong with an answer: 1, 1, 2, 3
    # m = 2 of N = 4: "1" is missed by 1 of the C(4, 2) = 6 pairs, "2" and "3" by 3 each
    assert rarefied_distinct_wrong(answers, scores, 2) == pytest.approx(5 / 6 + 1 / 2 + 1 / 2)
    assert rarefied_distinct_wrong(answers, scores, 4) == pytest.approx(3.0)  # all of them
    assert rarefied_distinct_wrong(answers, scores, 1) == pytest.approx(1.0)
    assert math.isnan(rarefied_distinct_wrong(answers, scores, 5))  # fewer wrong samples than m
    # the accuracy confound: fewer errors, same spread -> the same rarefied figure
    many, few = ["1", "2"] * 4, ["1", "2"]
    assert rarefied_distinct_wrong(many, [0] * 8, 2) == pytest.approx(1 + 1 - 2 * (4 * 3) / (8 * 7))
    assert rarefied_distinct_wrong(few, [0] * 2, 2) == pytest.approx(2.0)


def test_hill2_of_wrong_answers_by_hand():
    from medsrl.evaluation.diversity import hill2_wrong

    assert hill2_wrong(["1", "1", "2", "3", "9"], [0, 0, 0, 0, 1]) == pytest.approx(1 / (0.25 + 0.0625 + 0.0625))
    assert hill2_wrong(["4"] * 5, [0] * 5) == pytest.approx(1.0)
    assert math.isnan(hill2_wrong(["9"], [1]))
