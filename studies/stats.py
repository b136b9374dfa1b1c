"""Significance statistics for comparing two RL methods over a few seeds and many problems.

Two sources of noise: seeds (another seed trains another policy; Welch's t over per-seed scores,
little power with 3 seeds; with arms that share seeds, the paired test on per-seed differences,
its smallest detectable effect and a TOST equivalence test) and problems (the benchmark is a
finite sample; a paired test over problems, scores averaged over seeds, or within each seed). A
difference is significant only when both reject, so neither source alone can make it look real
(docs/STUDY.md). Differences are ``b - a`` (treatment minus baseline); non-finite values are
dropped; random draws use a fixed seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from medsrl.evaluation.passk import pass_at_k

ALPHA = 0.05


@dataclass(frozen=True)
class WelchResult:
    """Welch's two-sample t-test of ``b`` against ``a``."""

    t: float  # (mean(b) - mean(a)) / standard error
    dof: float  # Welch-Satterthwaite degrees of freedom
    p: float  # two-sided


@dataclass(frozen=True)
class PairedResult:
    """Paired test over problems of per-problem scores ``b`` against ``a``."""

    diff: float  # mean over problems of b - a
    ci_low: float  # percentile bootstrap 95% CI of diff, resampling problems
    ci_high: float
    p: float  # two-sided sign-flip permutation p-value
    problems: int  # problems in the test (pairs with both values finite)
    exact: bool  # True: all 2^P sign flips enumerated; False: `rounds` random flips


@dataclass(frozen=True)
class Comparison:
    """Both tests of one metric, and the verdict that needs both (a: the baseline, b: the
    method); the fields are the study's ``results.json`` keys."""

    baseline_mean: float
    baseline_std: float
    method_mean: float
    method_std: float
    diff: float  # mean over seeds of b minus mean over seeds of a
    welch: WelchResult
    paired: PairedResult | None  # None: no per-problem scores
    significant: bool
    verdict: str


def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64).ravel()
    return x[np.isfinite(x)]


def mean_std(values) -> tuple[float, float]:
    """(mean, sample std with ddof=1) of the finite values; std ``nan`` for one value. ddof=1:
    the seeds are a sample of all seeds, and the report states the spread of a new seed."""
    x = _finite(values)
    if len(x) == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else math.nan


def welch_t_test(a, b) -> WelchResult:
    """Welch's t-test of ``mean(b) - mean(a)``, two-sided: two methods need not have the same
    seed variance. All ``nan`` with fewer than 2 values on a side; with no variance, equal means
    give t = 0, p = 1 and different ones p = ``nan`` (the test cannot judge)."""
    from scipy.stats import t as student_t

    x, y = _finite(a), _finite(b)
    if len(x) < 2 or len(y) < 2:
        return WelchResult(math.nan, math.nan, math.nan)
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    diff = float(y.mean() - x.mean())
    se2 = va + vb
    if se2 == 0.0:
        if diff == 0.0:
            return WelchResult(0.0, math.nan, 1.0)
        return WelchResult(math.copysign(math.inf, diff), math.nan, math.nan)
    t = diff / math.sqrt(se2)
    dof = se2**2 / (va**2 / (len(x) - 1) + vb**2 / (len(y) - 1))
    return WelchResult(float(t), float(dof), float(min(1.0, 2.0 * student_t.sf(abs(t), dof))))


def paired_problem_test(a, b, *, rounds: int = 10000, seed: int = 0) -> PairedResult:
    """Mean of ``b - a`` over problems (``a[i]``, ``b[i]``: scores on problem i; non-finite
    pairs dropped), its bootstrap 95% CI and a sign-flip permutation p. Paired, because most of
    the variation is between problems (easy vs hard). p = (1 + #{|flipped mean| >= |observed|})
    / (1 + rounds), or exact over all 2^P flips when 2^P <= rounds."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"need the same problems on both sides, got {len(x)} and {len(y)}")
    keep = np.isfinite(x) & np.isfinite(y)
    d = y[keep] - x[keep]
    n = len(d)
    if n == 0:
        return PairedResult(math.nan, math.nan, math.nan, math.nan, 0, False)
    observed = float(d.mean())
    boot_rng = np.random.default_rng([seed, 0])
    flip_rng = np.random.default_rng([seed, 1])
    boot = np.concatenate(
        [d[boot_rng.integers(0, n, size=(m, n))].mean(axis=1) for m in _chunks(rounds, n)]
    )
    lo, hi = np.percentile(boot, [2.5, 97.5])
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))  # float noise must not beat an exact tie
    exact = 2**n <= rounds
    if exact:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
        hits = int((np.abs(signs @ d / n) >= abs(observed) - tol).sum())
        p = hits / 2**n
    else:
        hits = 0
        for m in _chunks(rounds, n):
            signs = flip_rng.choice(np.array([-1.0, 1.0]), size=(m, n))
            hits += int((np.abs(signs @ d / n) >= abs(observed) - tol).sum())
        p = (1 + hits) / (1 + rounds)
    return PairedResult(observed, float(lo), float(hi), float(min(1.0, p)), n, exact)


@dataclass(frozen=True)
class PairedSeeds:
    """Paired comparison of two arms that share seeds (same data order and warm start per seed):
    the per-seed differences ``b - a``, their t-test, the smallest effect the design detects, and
    a TOST equivalence test against a margin fixed in the protocol."""

    diff: float  # mean over seeds of b - a
    sd: float  # sample std (ddof=1) of the per-seed differences
    seeds: int
    p: float  # two-sided paired t-test (scipy.stats.ttest_rel)
    detectable: float  # smallest |diff| found with `power` at two-sided `alpha`, given sd and seeds
    margin: float  # the equivalence margin (nan: none asked)
    p_equivalent: float  # TOST: the larger of the two one-sided p-values
    equivalent: bool  # p_equivalent < alpha: the difference lies within +-margin


def detectable_effect(sd: float, n: int, *, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The smallest true mean difference a paired t-test over ``n`` differences of std ``sd``
    detects with probability ``power`` at two-sided ``alpha``: (t_{1-alpha/2} + t_{power}) * sd /
    sqrt(n), both quantiles at n - 1 degrees of freedom (the usual approximation of the
    noncentral t). ``nan`` below 2 differences."""
    from scipy.stats import t as student_t

    if n < 2 or not math.isfinite(sd):
        return math.nan
    return float((student_t.ppf(1 - alpha / 2, n - 1) + student_t.ppf(power, n - 1)) * sd / math.sqrt(n))


def paired_seed_test(a, b, *, margin: float = math.nan, alpha: float = ALPHA, power: float = 0.8) -> PairedSeeds:
    """``a[s]``, ``b[s]``: the metric of seed s under each arm (the same seeds, in the same order;
    a pair with a non-finite value is dropped). Welch's test ignores the pairing and loses most
    of its power when seeds share most of their variance."""
    from scipy.stats import ttest_1samp, ttest_rel

    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"need the same seeds on both sides, got {len(x)} and {len(y)}")
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    d, n = y - x, int(keep.sum())
    if n < 2:
        return PairedSeeds(float(d.mean()) if n else math.nan, math.nan, n, math.nan, math.nan, margin, math.nan, False)
    sd = float(d.std(ddof=1))
    p = 1.0 if sd == 0.0 and d.mean() == 0.0 else float(ttest_rel(y, x).pvalue)
    p_eq = math.nan
    if math.isfinite(margin):
        if sd == 0.0:
            p_eq = 0.0 if abs(d.mean()) < margin else 1.0
        else:
            low = ttest_1samp(d, -margin, alternative="greater").pvalue
            high = ttest_1samp(d, margin, alternative="less").pvalue
            p_eq = float(max(low, high))
    return PairedSeeds(float(d.mean()), sd, n, p, detectable_effect(sd, n, alpha=alpha, power=power), margin,
                       p_eq, bool(math.isfinite(p_eq) and p_eq < alpha))


def within_seed_sign_flip(a, b, *, rounds: int = 10000, seed: int = 0) -> float:
    """Two-sided p of a sign-flip test over (seed, problem) pairs: ``a[s][i]``, ``b[s][i]`` are
    seed s's scores on problem i under each arm. Each pair's difference keeps its seed and problem
    and only its sign is flipped (``scipy.stats.permutation_test``, ``permutation_type='samples'``),
    so neither the seeds' nor the problems' spread is averaged away. Non-finite pairs dropped."""
    from scipy.stats import permutation_test

    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"need the same (seed, problem) pairs on both sides, got {len(x)} and {len(y)}")
    keep = np.isfinite(x) & np.isfinite(y)
    if not keep.any():
        return math.nan
    if np.all(x[keep] == y[keep]):
        return 1.0
    result = permutation_test((x[keep], y[keep]), lambda u, v, axis: np.mean(v - u, axis=axis),
                              permutation_type="samples", n_resamples=rounds, alternative="two-sided",
                              vectorized=True, rng=np.random.default_rng(seed))
    return float(result.pvalue)


def _chunks(rounds: int, n: int, budget: int = 2_000_000):
    """Round counts per batch so that one batch's [m, n] array stays at about ``budget`` cells."""
    step = max(1, budget // max(1, n))
    for start in range(0, rounds, step):
        yield min(step, rounds - start)


def per_problem_pass_at_k(scores_per_problem: Sequence[Sequence[float]], k: int) -> np.ndarray:
    """Unbiased pass@k [P] of each problem (its own n >= k) from its graded samples: the paired
    test needs one number per problem, and their mean is the benchmark's pass@k."""
    out = [pass_at_k(len(s), sum(float(x) >= 1.0 for x in s), k) for s in scores_per_problem]
    return np.asarray(out, dtype=np.float64)


def compare(
    a_seeds, b_seeds, a_problems=None, b_problems=None, *, a_label: str = "baseline",
    b_label: str = "treatment", rounds: int = 10000,
) -> Comparison:
    """Seed-level Welch test and problem-level paired test of one metric, and a verdict.
    ``*_seeds``: the metric of each seed's policy; ``*_problems``: per-problem values (averaged
    over seeds) of the same problems in the same order, or ``None``."""
    a_mean, a_std = mean_std(a_seeds)
    b_mean, b_std = mean_std(b_seeds)
    welch = welch_t_test(a_seeds, b_seeds)
    paired = None
    if a_problems is not None and b_problems is not None:
        paired = paired_problem_test(a_problems, b_problems, rounds=rounds)
    diff = b_mean - a_mean
    significant, text = verdict(diff, welch, paired, a_label, b_label)
    return Comparison(a_mean, a_std, b_mean, b_std, diff, welch, paired, significant, text)


def verdict(
    diff: float, welch: WelchResult, paired: PairedResult | None, a_label: str, b_label: str
) -> tuple[bool, str]:
    """(significant, plain sentence): significant only if both tests reject in the same
    direction, since either alone overstates the evidence (module docstring)."""
    seed_p = welch.p
    prob_p = paired.p if paired is not None else math.nan
    both = all(math.isfinite(p) and p < ALPHA for p in (seed_p, prob_p))
    same_way = paired is not None and np.sign(diff) == np.sign(paired.diff) and diff != 0
    if both and same_way:
        word = "higher" if diff > 0 else "lower"
        return True, f"{b_label} {word} than {a_label} (both p < {ALPHA:g})"
    if paired is None:
        why = "no per-problem scores"
    elif both:
        why = "the two tests point in opposite directions"
    else:
        why = (
            f"seed-level p = {format_p(seed_p)}, problem-level p = {format_p(prob_p)}; "
            f"needs both < {ALPHA:g}"
        )
    return False, f"no difference shown ({why})"


def format_mean_std(mean: float, std: float = math.nan, scale: float = 1.0) -> str:
    """``41.3 ± 1.2``: the numbers times ``scale``, one decimal for a percentage (scale 100),
    else two; no ``± std`` when it is nan, ``-`` when the mean is."""
    if math.isnan(mean):
        return "-"
    digits = 1 if scale != 1.0 else 2
    text = f"{scale * mean:.{digits}f}"
    return text if math.isnan(std) else f"{text} ± {scale * std:.{digits}f}"


def format_p(p: float) -> str:
    """A p-value for prose: 2 significant digits, ``<0.001`` below that, ``n/a`` if undefined."""
    if not math.isfinite(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.2g}"
