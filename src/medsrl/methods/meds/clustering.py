"""MEDS error clustering: HDBSCAN over a prompt's stored features, k-NN label prediction, sizes.

Reference behaviour (PAPER.md, steps 4-5): a new response's cluster is *predicted* from the labels
already stored for its (prompt, correctness) key by a k=3 nearest-neighbour vote under cosine
distance; its cluster size is the number of stored points carrying that label. After the step's
features are inserted, the whole store is L2-normalised and HDBSCAN is re-fitted (Euclidean,
min_cluster_size=2, min_samples=1), which gives the labels the *next* visit of that key uses.

Everything here is a pure function of numpy arrays (no torch), so it can run in a worker process
without touching the training state (see ``refit.py``).
"""

from __future__ import annotations

import numpy as np

NOISE = -1  # HDBSCAN's label for points in no cluster


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` [N, D] scaled to unit L2 norm, as float64; all-zero rows stay zero.

    Why: MEDS clusters *directions* of the per-layer logit profile, not its scale; on unit
    vectors Euclidean distance is a monotone function of cosine distance
    (``|a-b|^2 = 2 - 2 cos``), so HDBSCAN (Euclidean) and the cosine k-NN agree on geometry.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, D], got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def fit_cluster_labels(
    features: np.ndarray, *, min_cluster_size: int = 2, min_samples: int = 1
) -> np.ndarray:
    """HDBSCAN labels [N] (int64, -1 = noise) of the L2-normalised rows of ``features`` [N, D].

    Too few points to form a cluster (N < 2, N < ``min_cluster_size`` or N <= ``min_samples``)
    gives all noise, as in the reference. Deterministic: hdbscan's default algorithm on this
    (low-dimensional, Euclidean) data is a Boruvka KD-tree whose result depends only on the rows
    and their order. ``core_dist_n_jobs=1`` keeps hdbscan from starting its own joblib workers
    (it only would above 16k points; the labels do not depend on it).
    """
    x = normalize_rows(features)
    n = x.shape[0]
    if n < max(2, min_cluster_size) or n <= min_samples:
        return np.full(n, NOISE, dtype=np.int64)
    if not np.isfinite(x).all():
        raise ValueError("features contain NaN or inf")
    import hdbscan  # deferred: the import is slow and only needed here

    model = hdbscan.HDBSCAN(
        min_cluster_size=min_cluster_size,
        min_samples=min_samples,
        metric="euclidean",
        core_dist_n_jobs=1,
    )
    return np.asarray(model.fit_predict(x), dtype=np.int64)


def predict_labels(
    stored: np.ndarray, stored_labels: np.ndarray, queries: np.ndarray, *, k: int = 3
) -> np.ndarray:
    """Predicted label [Q] (int64) of each query row: majority vote of its k nearest stored rows.

    Distance is cosine (``1 - cos``), so scaling a query or a stored row changes nothing. Ties:
    - between equal *distances*: the stored row with the lower index comes first (stable sort);
    - between equal *vote counts*: the smallest label wins, so noise (-1) wins any tie it is in
      (e.g. a 1-1-1 vote over labels {-1, 0, 3} gives -1; over {0, 2, 5} gives 0).
    ``k`` larger than the store uses all stored rows. An empty store predicts -1 for every query
    (and ``cluster_sizes`` then gives 0). A zero query row is at distance 1 from everything, so
    it takes the first k stored rows. Matches sklearn's ``KNeighborsClassifier(k, metric="cosine")``
    vote, whose mode also returns the smallest of the tied labels.
    """
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
    """Size [Q] (int64) of each predicted cluster: the number of stored rows with that label.

    Noise counts as one cluster by default (reference): a query predicted as noise gets the
    number of stored noise rows, so a key whose errors never cluster still accumulates pressure.
    ``noise_is_cluster=False`` gives noise predictions size 0. An empty store gives 0.
    """
    stored_labels = np.asarray(stored_labels, dtype=np.int64)
    predicted = np.asarray(predicted, dtype=np.int64)
    sizes = (predicted[:, None] == stored_labels[None, :]).sum(axis=1).astype(np.int64)
    if not noise_is_cluster:
        sizes[predicted == NOISE] = 0
    return sizes


def single_cluster_sizes(num_stored: int, num_queries: int) -> np.ndarray:
    """Sizes [num_queries] for the ``single`` ablation: the whole history of the key is one
    cluster, so every query gets ``num_stored`` (0 on the first visit)."""
    return np.full(num_queries, num_stored, dtype=np.int64)


def top1_eigen_ratio(features: np.ndarray) -> float:
    """Diversity metric ``lambda_1 / sum(lambda)`` of the covariance of the rows [N, D].

    Near 1: the rows vary along one direction (collapsed); lower: more diverse. Returns ``nan``
    when it is undefined: fewer than 2 rows (no covariance) or zero total variance (all rows
    equal). Callers averaging it over keys should use ``np.nanmean``.
    """
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
