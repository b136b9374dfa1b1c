"""MEDS error clustering (docs/REFERENCE.md, steps 4-5): a new response's cluster is predicted by a
k=3 cosine vote over the labels stored for its (prompt, correctness) key, its size the number of
stored points with that label; HDBSCAN re-fits the store for the key's next visit. No torch here:
it runs in worker processes (``methods/meds/refit.py``).
"""

from __future__ import annotations

import numpy as np

NOISE = -1  # HDBSCAN's label for points in no cluster


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` [N, D] scaled to unit L2 norm, as float64 (zero rows stay zero): on unit
    vectors ``|a-b|^2 = 2 - 2 cos``, so HDBSCAN (Euclidean) and the cosine k-NN agree."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, D], got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def distinct_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(index of each distinct row's first copy, in order; every row's distinct row [N])``: a
    step's identical texts give bit-identical features."""
    _, first, inverse = np.unique(np.asarray(x), axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return first[order], rank[inverse.reshape(-1)]


def fit_cluster_labels(
    features: np.ndarray, *, min_cluster_size: int = 2, min_samples: int = 1, dedup: bool = False
) -> np.ndarray:
    """HDBSCAN labels [N] (-1 = noise) of the L2-normalised rows of ``features`` [N, D]; all noise
    for too few points, as the reference. ``dedup`` (study v3, D1): fit the distinct rows only, so
    a clump of one step's identical responses is one point, not a dense cluster of its own."""
    if dedup and len(features):
        first, owner = distinct_rows(features)
        return fit_cluster_labels(np.asarray(features)[first], min_cluster_size=min_cluster_size,
                                  min_samples=min_samples)[owner]
    x = normalize_rows(features)
    n = x.shape[0]
    if n < max(2, min_cluster_size) or n <= min_samples:
        return np.full(n, NOISE, dtype=np.int64)
    if not np.isfinite(x).all():
        raise ValueError("features contain NaN or inf")
    import hdbscan  # deferred: the import is slow and only needed here

    model = hdbscan.HDBSCAN(min_cluster_size=min_cluster_size, min_samples=min_samples,
                            metric="euclidean", core_dist_n_jobs=1)
    return np.asarray(model.fit_predict(x), dtype=np.int64)


def predict_labels(
    stored: np.ndarray, stored_labels: np.ndarray, queries: np.ndarray, *, k: int = 3
) -> np.ndarray:
    """Predicted label [Q] of each query row: majority vote of its k nearest stored rows (cosine),
    ties as sklearn's ``KNeighborsClassifier`` (the lower stored index; the smallest label, so
    noise wins any tie it is in). An empty store predicts -1."""
    queries = np.asarray(queries)
    stored_labels = np.asarray(stored_labels, dtype=np.int64)
    num_q = queries.shape[0]
    if len(stored) != len(stored_labels):
        raise ValueError(f"{len(stored)} stored rows but {len(stored_labels)} labels")
    if len(stored) == 0 or num_q == 0:
        return np.full(num_q, NOISE, dtype=np.int64)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    s, q = normalize_rows(stored), normalize_rows(queries)
    if s.shape[1] != q.shape[1]:
        raise ValueError(f"stored dim {s.shape[1]} != query dim {q.shape[1]}")
    dist = 1.0 - q @ s.T  # [Q, N]
    k = min(k, s.shape[0])
    nearest = np.argsort(dist, axis=1, kind="stable")[:, :k]  # [Q, k]
    votes = stored_labels[nearest]  # [Q, k]
    # count[q, i] = how many of query q's k neighbours share neighbour i's label
    count = (votes[:, :, None] == votes[:, None, :]).sum(axis=2)
    is_top = count == count.max(axis=1, keepdims=True)
    return np.where(is_top, votes, np.iinfo(np.int64).max).min(axis=1)


def cluster_sizes(
    stored_labels: np.ndarray, predicted: np.ndarray, *, noise_is_cluster: bool = True
) -> np.ndarray:
    """Size [Q] of each predicted cluster: its stored rows. Noise counts as one cluster unless
    ``noise_is_cluster=False`` (the reference's way: a key whose errors never cluster still gains pressure)."""
    stored_labels = np.asarray(stored_labels, dtype=np.int64)
    predicted = np.asarray(predicted, dtype=np.int64)
    sizes = (predicted[:, None] == stored_labels[None, :]).sum(axis=1).astype(np.int64)
    if not noise_is_cluster:
        sizes[predicted == NOISE] = 0
    return sizes


def single_cluster_sizes(num_stored: int, num_queries: int) -> np.ndarray:
    """Sizes [num_queries] for the ``single`` ablation: the key's whole history is one cluster."""
    return np.full(num_queries, num_stored, dtype=np.int64)


def top1_eigen_ratio(features: np.ndarray) -> float:
    """``lambda_1 / sum(lambda)`` of the rows' covariance: near 1, they vary along one direction
    (collapsed); ``nan`` for fewer than 2 rows or all equal."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, D], got shape {x.shape}")
    if x.shape[0] < 2:
        return float("nan")
    centred = x - x.mean(axis=0, keepdims=True)
    cov = centred.T @ centred / (x.shape[0] - 1)
    eig = np.clip(np.linalg.eigvalsh(cov), 0.0, None)
    total = eig.sum()
    if total <= 0:
        return float("nan")
    return float(eig[-1] / total)
