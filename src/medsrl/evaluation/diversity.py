"""Diversity of one problem's n responses: distinct answers, feature spread, error clusters.

MEDS claims that penalising repeated errors makes a policy explore: its wrong answers should be
more varied (more distinct strings, more clusters in feature space) and its features less
concentrated along one direction (lower top-1 eigen ratio). Feature rows and geometry are those
of MEDS training (the per-response vectors its memory stores).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from medsrl.evaluation.passk import answer_key
from medsrl.features.clustering import fit_cluster_labels, top1_eigen_ratio

DIVERSITY_KEYS = ("distinct_answers", "distinct_wrong", "eigen_ratio", "wrong_clusters")


def distinct_answers(answers: Sequence[str | None]) -> int:
    """Number of different answers, grouped as in majority voting (``answer_key``: exact string
    after stripping). Samples with no answer are not counted."""
    return len({answer_key(a) for a in answers} - {None})


def distinct_wrong_answers(answers: Sequence[str | None], scores: Sequence[float]) -> int:
    """Number of different *wrong* answers (score < 1, an answer given): a problem has one right
    answer, so the spread of the errors is what repeated-error penalties are meant to change."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    return len({answer_key(a) for a, s in zip(answers, scores, strict=True) if s < 1.0} - {None})


def _wrong_answer_counts(answers: Sequence[str | None], scores: Sequence[float]) -> np.ndarray:
    """How often each distinct wrong answer was given (``answer_key``; no answer left out)."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    keys = [answer_key(a) for a, s in zip(answers, scores, strict=True) if s < 1.0]
    _, counts = np.unique([k for k in keys if k is not None], return_counts=True)
    return counts


def rarefied_distinct_wrong(answers: Sequence[str | None], scores: Sequence[float], m: int) -> float:
    """The expected number of distinct wrong answers among ``m`` of the problem's wrong samples
    drawn without replacement (Hurlbert's rarefaction: sum over answers of 1 - C(N - N_a, m) /
    C(N, m)): a policy that errs less has fewer wrong samples and so fewer distinct ones; at a
    fixed m that confound is gone. ``nan`` with fewer than ``m`` wrong samples (with an answer)."""
    counts = _wrong_answer_counts(answers, scores)
    total = int(counts.sum())
    if m < 1 or total < m:
        return float("nan")
    # C(N - N_a, m) / C(N, m) as a product, exact for any sizes
    miss = [np.prod([(total - c - i) / (total - i) for i in range(m)]) if total - c >= m else 0.0 for c in counts]
    return float(sum(1.0 - q for q in miss))


def hill2_wrong(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """Hill number of order 2 (inverse Simpson, 1 / sum p_a^2) of the wrong answers' shares: the
    number of equally common answers that would give the same repeat rate; ``nan`` without any."""
    counts = _wrong_answer_counts(answers, scores)
    if counts.sum() == 0:
        return float("nan")
    p = counts / counts.sum()
    return float(1.0 / np.sum(p**2))


def wrong_cluster_count(
    features: np.ndarray, *, min_cluster_size: int = 2, min_samples: int = 1
) -> int:
    """Number of error modes among the wrong responses' feature rows [N, D], clustered as in MEDS
    training, the noise points together one cluster: errors all alike give 1."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, D], got shape {x.shape}")
    if x.shape[0] == 0:
        return 0
    labels = fit_cluster_labels(x, min_cluster_size=min_cluster_size, min_samples=min_samples)
    return len(set(labels.tolist()))


def problem_diversity(
    answers: Sequence[str | None], scores: Sequence[float], features: np.ndarray | None = None
) -> dict[str, float]:
    """All diversity figures of one problem, keyed by ``DIVERSITY_KEYS``. ``features`` [n, D]: row i
    is response i's, NaN where it has none (left out); the eigen ratio uses every present row, the
    cluster count those of wrong responses; both ``nan`` without ``features``."""
    out = {
        "distinct_answers": float(distinct_answers(answers)),
        "distinct_wrong": float(distinct_wrong_answers(answers, scores)),
        "eigen_ratio": float("nan"),
        "wrong_clusters": float("nan"),
    }
    if features is None:
        return out
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != len(scores):
        raise ValueError(f"features must be [{len(scores)}, D], got shape {x.shape}")
    present = np.isfinite(x).all(axis=1)
    wrong = np.asarray(scores, dtype=np.float64) < 1.0
    out["eigen_ratio"] = top1_eigen_ratio(x[present])  # as the metric meds/top1_eigen_ratio
    out["wrong_clusters"] = float(wrong_cluster_count(x[present & wrong]))
    return out
