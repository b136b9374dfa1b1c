"""The study's statistics against numbers worked out by hand from their formulas."""

import math

import numpy as np
import pytest
from studies.stats import (
    compare,
    format_p,
    mean_std,
    paired_problem_test,
    per_problem_pass_at_k,
    welch_t_test,
)


def t_two_sided_p(t, dof, points=400_001):
    """2 * P(T > |t|) by Simpson's rule on the Student t density, after x = |t| + u / (1 - u)
    maps [|t|, inf) onto [0, 1); independent of scipy."""
    u = np.linspace(0.0, 1.0, points)[:-1]
    u = np.append(u, 1.0 - 1e-12)
    x = abs(t) + u / (1.0 - u)
    dxdu = 1.0 / (1.0 - u) ** 2
    const = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
    f = const * (1.0 + x**2 / dof) ** (-(dof + 1) / 2) * dxdu
    h = u[1] - u[0]
    simpson = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return 2 * simpson


def test_mean_std_by_hand():
    mean, std = mean_std([0.30, 0.36, 0.33])
    assert mean == pytest.approx(0.33)
    # deviations -0.03, 0.03, 0: sum of squares 0.0018 over n - 1 = 2
    assert std == pytest.approx(math.sqrt(0.0018 / 2))
    one = mean_std([0.5])
    assert one[0] == 0.5 and math.isnan(one[1])
    assert all(math.isnan(v) for v in mean_std([]))
    assert mean_std([1.0, float("nan"), 3.0]) == pytest.approx((2.0, math.sqrt(2.0)))


def test_welch_by_hand():
    a = [0.30, 0.36, 0.33]  # mean .33, var .0009
    b = [0.40, 0.46, 0.38, 0.44]  # mean .42, var (.0004+.0016+.0016+.0004)/3 = .004/3
    va, vb = 0.0009 / 3, (0.004 / 3) / 4
    t = (0.42 - 0.33) / math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    res = welch_t_test(a, b)
    assert res.t == pytest.approx(t)
    assert res.dof == pytest.approx(dof)
    assert res.p == pytest.approx(t_two_sided_p(t, dof), rel=1e-6)
    # the direction is b - a, and swapping the sides only flips t
    swapped = welch_t_test(b, a)
    assert swapped.t == pytest.approx(-t) and swapped.p == pytest.approx(res.p)


def test_welch_agrees_with_scipy():
    from scipy import stats

    rng = np.random.default_rng(3)
    a, b = rng.normal(0, 1, 3), rng.normal(0.5, 2, 3)
    ref = stats.ttest_ind(b, a, equal_var=False)
    res = welch_t_test(a, b)
    assert res.t == pytest.approx(ref.statistic) and res.p == pytest.approx(ref.pvalue)


def test_welch_degenerate():
    assert all(
        math.isnan(v) for v in (welch_t_test([1.0], [1.0, 2.0]).t, welch_t_test([1.0], [2.0]).p)
    )
    same = welch_t_test([0.5, 0.5], [0.5, 0.5])
    assert same.t == 0 and same.p == 1
    apart = welch_t_test([0.5, 0.5], [0.6, 0.6])  # no variance: the test cannot judge
    assert apart.t == math.inf and math.isnan(apart.p)


def test_paired_clear_difference():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.2, 0.6, size=200)
    b = a + 0.05 + rng.normal(0, 0.02, size=200)
    res = paired_problem_test(a, b)
    assert res.diff == pytest.approx(float(np.mean(b - a)))
    assert res.p < 0.01 and not res.exact
    assert res.p == pytest.approx(1 / 10001)  # no random flip comes near the observed mean
    assert 0.04 < res.ci_low < res.diff < res.ci_high < 0.06
    assert res.problems == 200


def test_paired_identical_inputs():
    a = np.linspace(0, 1, 50)
    res = paired_problem_test(a, a.copy())
    assert res.diff == 0 and res.p == 1.0
    assert (res.ci_low, res.ci_high) == (0.0, 0.0)


def test_paired_no_difference_is_not_significant():
    rng = np.random.default_rng(1)
    a = rng.uniform(size=300)
    b = a + rng.normal(0, 0.1, size=300)
    b -= np.mean(b - a)  # mean difference exactly 0
    res = paired_problem_test(a, b)
    assert res.p > 0.9 and res.ci_low < 0 < res.ci_high


def test_paired_deterministic_and_seeded():
    rng = np.random.default_rng(2)
    a, b = rng.uniform(size=80), rng.uniform(size=80)
    first = paired_problem_test(a, b, rounds=2000, seed=5)
    assert paired_problem_test(a, b, rounds=2000, seed=5) == first
    assert paired_problem_test(a, b, rounds=2000, seed=6) != first


def test_paired_exact_enumeration():
    # 4 problems, all differences +1: of the 16 sign patterns only all-plus and all-minus reach
    # |mean| = 1, so p = 2/16 exactly
    res = paired_problem_test([0, 0, 0, 0], [1, 1, 1, 1])
    assert res.exact and res.p == pytest.approx(2 / 16)
    assert res.ci_low == res.ci_high == 1.0


def test_paired_drops_nan_pairs_and_checks_shapes():
    res = paired_problem_test([0.1, np.nan, 0.3], [0.2, 0.5, np.nan])
    assert res.problems == 1 and res.diff == pytest.approx(0.1)
    with pytest.raises(ValueError):
        paired_problem_test([0.1, 0.2], [0.1])


def test_per_problem_pass_at_k():
    scores = [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    # pass@2 with c=1 of 4: 1 - C(3,2)/C(4,2) = 0.5; c=3: 1; c=0: 0
    assert per_problem_pass_at_k(scores, 2).tolist() == pytest.approx([0.5, 1.0, 0.0])
    assert per_problem_pass_at_k(scores, 1).tolist() == pytest.approx([0.25, 0.75, 0.0])
    # partial credit (score < 1) is not correct
    assert per_problem_pass_at_k([[0.5, 1.0]], 1).tolist() == [0.5]


def test_compare_verdicts():
    rng = np.random.default_rng(4)
    a_prob = rng.uniform(0.2, 0.6, size=200)
    b_prob = a_prob + 0.1 + rng.normal(0, 0.02, size=200)
    clear = compare(
        [0.30, 0.31, 0.32], [0.40, 0.41, 0.42], a_prob, b_prob, a_label="DAPO", b_label="MEDS"
    )
    assert clear.significant and clear.verdict == "MEDS higher than DAPO (both p < 0.05)"
    assert clear.diff == pytest.approx(0.10)
    # seeds too noisy: the problem-level test alone does not make it significant
    noisy = compare([0.2, 0.4, 0.3], [0.3, 0.5, 0.25], a_prob, b_prob)
    assert noisy.welch.p > 0.05 and noisy.paired.p < 0.05 and not noisy.significant
    assert noisy.verdict.startswith("no difference shown (seed-level p = ")
    no_problems = compare([0.30, 0.31, 0.32], [0.40, 0.41, 0.42])
    assert not no_problems.significant and "no per-problem scores" in no_problems.verdict
    # the two tests disagree on the direction
    opposite = compare([0.30, 0.31, 0.32], [0.40, 0.41, 0.42], b_prob, a_prob)
    assert not opposite.significant and "opposite" in opposite.verdict


def test_format_p():
    assert format_p(0.04321) == "0.043" and format_p(0.0001) == "<0.001"
    assert format_p(float("nan")) == "n/a"


def test_paired_seeds_against_hand_worked_t_detectable_effect_and_tost():
    from studies.stats import detectable_effect, paired_seed_test

    a, b = [1.0, 2.0, 3.0, 4.0], [1.5, 2.1, 3.6, 4.2]  # d = 0.5, 0.1, 0.6, 0.2
    sd = math.sqrt((0.15**2 + 0.25**2 + 0.25**2 + 0.15**2) / 3)  # 0.2380
    se = sd / 2
    r = paired_seed_test(a, b, margin=1.0)
    assert (r.diff, r.seeds) == (pytest.approx(0.35), 4) and r.sd == pytest.approx(sd)
    assert r.p == pytest.approx(t_two_sided_p(0.35 / se, 3), abs=1e-6)
    # t quantiles at 3 dof from a table: 0.975 -> 3.1824, 0.80 -> 0.9785
    assert r.detectable == pytest.approx((3.1824 + 0.9785) * sd / 2, rel=1e-3)
    assert detectable_effect(sd, 4) == pytest.approx(r.detectable)
    # TOST: the larger one-sided p; the upper side, t = (0.35 - 1) / se, decides
    assert r.p_equivalent == pytest.approx(t_two_sided_p((0.35 - 1.0) / se, 3) / 2, abs=1e-6) and r.equivalent
    narrow = paired_seed_test(a, b, margin=0.3)  # t = 0.05 / se: p about 0.35, not equivalent
    assert narrow.p_equivalent == pytest.approx(1 - t_two_sided_p(0.05 / se, 3) / 2, abs=1e-6)
    assert not narrow.equivalent
    # Welch, unpaired, cannot see a shift this small against the seeds' own spread
    assert welch_t_test(a, b).p > 0.5 > r.p


def test_paired_seeds_edge_cases():
    from studies.stats import paired_seed_test

    same = paired_seed_test([1.0, 2.0], [1.0, 2.0], margin=0.1)
    assert (same.p, same.p_equivalent, same.equivalent) == (1.0, 0.0, True)
    one = paired_seed_test([1.0, math.nan], [2.0, 3.0])
    assert one.seeds == 1 and math.isnan(one.p) and math.isnan(one.detectable)
    with pytest.raises(ValueError, match="same seeds"):
        paired_seed_test([1.0], [1.0, 2.0])


def test_within_seed_sign_flip_is_exact_on_few_pairs():
    from studies.stats import within_seed_sign_flip

    a = [[0.0, 0.0], [0.0, 0.0]]  # 2 seeds x 2 problems
    # every difference +1: of the 16 sign patterns, 2 reach |mean| >= 1
    assert within_seed_sign_flip(a, [[1.0, 1.0], [1.0, 1.0]]) == pytest.approx(2 / 16)
    # +1 and -1 on one seed, +1 on the other: |mean| >= 0.5 in 10 of 16 patterns
    assert within_seed_sign_flip(a, [[1.0, -1.0], [1.0, 1.0]]) == pytest.approx(10 / 16)
    assert within_seed_sign_flip(a, a) == 1.0
