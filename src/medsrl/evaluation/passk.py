"""Unbiased pass@k over n samples per problem, and majority-vote accuracy (maj@n). A response
is *correct* when its score is 1 (the grader's full credit), as in the rest of the package."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021), ``1 - C(n-c, k) / C(n, k)``, as ``1 - prod_{i=n-c+1}^{n}
    (1 - k/i)``, finite where the binomials overflow a float."""
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(n: int, correct_counts: np.ndarray | Sequence[int], ks: Sequence[int]) -> dict[int, float]:
    """``{k: pass@k averaged over problems}``; a float count raises ``TypeError``, not truncated."""
    if len(correct_counts) == 0:
        raise ValueError("no problems: pass@k of an empty benchmark is undefined")
    counts = np.asarray(correct_counts).ravel().tolist()
    return {int(k): float(np.mean([pass_at_k(n, c, k) for c in counts])) for k in ks}


def cover_at(n: int | Sequence[int], correct_counts: np.ndarray | Sequence[int], tau: float) -> float:
    """Cover@tau: the share of problems whose own accuracy c / n is at least ``tau``."""
    c = np.asarray(correct_counts, dtype=np.float64)
    if c.size == 0:
        return float("nan")
    return float(np.mean(c / np.asarray(n, dtype=np.float64) >= tau))


def default_ks(n: int) -> list[int]:
    """``[1, 2, 4, ..., n]``: the powers of 2 up to ``n``, plus ``n`` itself."""
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    ks = [1 << i for i in range(n.bit_length())]
    return ks if ks[-1] == n else [*ks, n]


def answer_key(answer: str | None) -> str | None:
    """The stripped answer (``None``: none); ``1/2`` and ``\\frac{1}{2}`` are two answers here."""
    return None if answer is None else (answer.strip() or None)


def majority_vote_correct(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """1.0 if one problem's most frequent answer (no answer: no vote) is correct; ties: first seen."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    keys = [answer_key(a) for a in answers]
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return 0.0
    winner = votes.most_common(1)[0][0]  # equal counts keep the order first seen
    return 1.0 if scores[keys.index(winner)] >= 1.0 else 0.0
