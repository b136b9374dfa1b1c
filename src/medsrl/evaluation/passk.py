"""Unbiased pass@k over n samples per problem, and majority-vote accuracy (maj@n). A response
is *correct* when its score is 1 (the grader's full credit), as in the rest of the package."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (Chen et al., 2021):
    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which stays
    finite where the binomials overflow a float (n in the thousands)."""
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_array(n: int, correct_counts: np.ndarray | Sequence[int], k: int) -> np.ndarray:
    """pass@k [P] (float64) of each problem from its correct count out of ``n``; a float count
    raises ``TypeError`` rather than being truncated."""
    counts = np.asarray(correct_counts).ravel().tolist()
    return np.array([pass_at_k(n, c, k) for c in counts], dtype=np.float64)


def mean_pass_at_k(n: int, correct_counts: np.ndarray | Sequence[int], ks: Sequence[int]) -> dict[int, float]:
    """``{k: pass@k averaged over problems}``; the benchmark-level figure a paper reports."""
    if len(correct_counts) == 0:
        raise ValueError("no problems: pass@k of an empty benchmark is undefined")
    return {int(k): float(pass_at_k_array(n, correct_counts, k).mean()) for k in ks}


def cover_at(n: int | Sequence[int], correct_counts: np.ndarray | Sequence[int], tau: float) -> float:
    """Cover@tau: the share of problems whose own accuracy c / n is at least ``tau`` (tau -> 0 is
    "solved at all", tau = 1 "always solved"): how far the solved set reaches at each reliability."""
    c = np.asarray(correct_counts, dtype=np.float64)
    if c.size == 0:
        return float("nan")
    return float(np.mean(c / np.asarray(n, dtype=np.float64) >= tau))


def default_ks(n: int) -> list[int]:
    """``[1, 2, 4, ..., n]``: the powers of 2 up to ``n`` (curves are read on a log-2 k axis),
    plus ``n`` itself if it is not one."""
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    ks = [1 << i for i in range(n.bit_length())]
    return ks if ks[-1] == n else [*ks, n]


def answer_key(answer: str | None) -> str | None:
    """Grouping key of an extracted answer: the stripped string, ``None`` for no answer. Only
    exact strings are merged: ``1/2`` and ``\\frac{1}{2}`` are two answers here."""
    return None if answer is None else (answer.strip() or None)


def majority_vote_correct(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """1.0 if the most frequent answer (by ``answer_key``; no answer: no vote) among the samples
    of one problem is correct, else 0.0; a tie goes to the answer seen first."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    keys = [answer_key(a) for a in answers]
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return 0.0
    winner = votes.most_common(1)[0][0]  # equal counts keep the order first seen
    return 1.0 if scores[keys.index(winner)] >= 1.0 else 0.0
