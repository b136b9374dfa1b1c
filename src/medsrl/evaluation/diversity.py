"""Diversity of one problem's n responses: distinct answers, feature spread, error clusters. MEDS
claims penalising repeated errors makes wrong answers more varied and features less concentrated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from medsrl.evaluation.passk import answer_key
from medsrl.features.clustering import fit_cluster_labels, top1_eigen_ratio

DIVERSITY_KEYS = ("distinct_answers", "distinct_wrong", "eigen_ratio", "wrong_clusters")


def distinct_answers(answers: Sequence[str | None]) -> int:
    """Number of different answers (``answer_key``), no answer not counted."""
    return len({answer_key(a) for a in answers} - {None})


def distinct_wrong_answers(answers: Sequence[str | None], scores: Sequence[float]) -> int:
    """Number of different *wrong* answers (score < 1): what repeated-error penalties mean to change."""
    return len(_wrong_answer_counts(answers, scores))


def _wrong_answer_counts(answers: Sequence[str | None], scores: Sequence[float]) -> np.ndarray:
    """How often each distinct wrong answer was given (``answer_key``; no answer left out)."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    keys = [answer_key(a) for a, s in zip(answers, scores, strict=True) if s < 1.0]
    _, counts = np.unique([k for k in keys if k is not None], return_counts=True)
    return counts


def rarefied_distinct_wrong(answers: Sequence[str | None], scores: Sequence[float], m: int) -> float:
    """Expected distinct wrong answers among ``m`` wrong samples (Hurlbert's rarefaction), free of the
    fewer-errors confound; ``nan`` with fewer than ``m`` wrong samples."""
    counts = _wrong_answer_counts(answers, scores)
    total = int(counts.sum())
    if m < 1 or total < m:
        return float("nan")
    # C(N - N_a, m) / C(N, m) as a product, exact for any sizes
    miss = [np.prod([(total - c - i) / (total - i) for i in range(m)]) if total - c >= m else 0.0 for c in counts]
    return float(sum(1.0 - q for q in miss))


def hill2_wrong(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """Hill number of order 2 (1 / sum p_a^2) of the wrong answers' shares; ``nan`` without any."""
    counts = _wrong_answer_counts(answers, scores)
    if counts.sum() == 0:
        return float("nan")
    p = counts / counts.sum()
    return float(1.0 / np.sum(p**2))


def wrong_cluster_count(features: np.ndarray, *, min_cluster_size: int = 2, min_samples: int = 1) -> int:
    """Error modes among wrong responses' feature rows [N, D], clustered as MEDS does (noise: one)."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, D], got shape {x.shape}")
    if x.shape[0] == 0:
        return 0
    labels = fit_cluster_labels(x, min_cluster_size=min_cluster_size, min_samples=min_samples)
    return len(set(labels.tolist()))


def problem_diversity(answers: Sequence[str | None], scores: Sequence[float],
                      features: np.ndarray | None = None) -> dict[str, float]:
    """``DIVERSITY_KEYS`` of one problem; ``features`` [n, D] with NaN rows for responses without."""
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
