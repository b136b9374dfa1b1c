"""Clustering, k-NN prediction and cluster sizes on hand-built data with known answers."""

import math

import numpy as np
import pytest

from medsrl.features.clustering import (
    cluster_sizes,
    fit_cluster_labels,
    normalize_rows,
    predict_labels,
    single_cluster_sizes,
    top1_eigen_ratio,
)
from medsrl.methods.meds.penalty import meds_penalty

E = np.eye(4)
STEP = 0.01  # radians between neighbouring points of a blob


def arc(u, v, n, start=0.0):
    """n unit vectors on the great circle from u towards v, STEP radians apart: equal spacing,
    and already normalised, so HDBSCAN sees each blob as one cluster that never splits."""
    return np.stack(
        [math.cos(start + k * STEP) * u + math.sin(start + k * STEP) * v for k in range(n)]
    )


# three tight blobs of 5, 3 and 2 points, and two outliers far from everything and each other
BLOB5, BLOB3, BLOB2 = arc(E[0], E[1], 5), arc(E[1], E[2], 3), arc(E[2], E[3], 2)
OUTLIERS = np.array([E[3], -np.ones(4) / 2])
STORE = np.concatenate([BLOB5, BLOB3, BLOB2, OUTLIERS]).astype(np.float32)


@pytest.fixture(scope="module")
def labels():
    return fit_cluster_labels(STORE)


def test_known_blobs_get_one_label_each_and_outliers_are_noise(labels):
    assert labels.dtype == np.int64 and labels.shape == (12,)
    a, b, c = labels[:5], labels[5:8], labels[8:10]
    for blob in (a, b, c):
        assert len(set(blob)) == 1 and blob[0] >= 0
    assert len({a[0], b[0], c[0]}) == 3
    assert list(labels[10:]) == [-1, -1]


def test_fit_is_deterministic_and_scale_invariant(labels):
    scales = np.array([0.5, 3, 7, 1, 2, 9, 0.1, 4, 5, 6, 8, 11], dtype=np.float32)[:, None]
    assert np.array_equal(fit_cluster_labels(STORE), labels)
    assert np.array_equal(fit_cluster_labels(STORE * scales), labels)


def test_fewer_than_two_points_are_noise():
    assert fit_cluster_labels(np.zeros((0, 14), np.float32)).tolist() == []
    assert fit_cluster_labels(np.ones((1, 14), np.float32)).tolist() == [-1]
    assert fit_cluster_labels(STORE[:3], min_cluster_size=4).tolist() == [-1, -1, -1]


def test_fit_rejects_nan():
    bad = STORE.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fit_cluster_labels(bad)


def test_gaussian_blobs_clusters_are_pure():
    rng = np.random.default_rng(0)
    centres = np.eye(14)[:3] * 10 + 1
    x = np.concatenate([c + rng.normal(0, 0.05, (20, 14)) for c in centres]).astype(np.float32)
    lab = fit_cluster_labels(x)
    for b in range(3):  # no cluster spans two blobs
        inside = set(lab[20 * b : 20 * (b + 1)]) - {-1}
        outside = set(np.delete(lab, np.s_[20 * b : 20 * (b + 1)]))
        assert inside and not inside & outside


def test_query_near_the_five_blob_has_size_five_and_its_penalty(labels):
    query = arc(E[0], E[1], 1, start=2.5 * STEP)  # between the 3rd and 4th point of BLOB5
    pred = predict_labels(STORE, labels, query)
    assert pred[0] == labels[0]
    size = cluster_sizes(labels, pred)
    assert size.tolist() == [5]
    assert meds_penalty(size, alpha=0.1)[0] == pytest.approx(0.1 * math.log(6))  # 0.17918 < cap
    assert meds_penalty(size, alpha=0.1, beta=0.15)[0] == pytest.approx(0.15)


def test_query_on_an_outlier_is_noise_by_tie_and_gets_the_noise_count(labels):
    # neighbours of e4: the outlier e4 itself (-1), BLOB2's 2nd point (cos 0.01), then a tie at
    # distance exactly 1 among many rows, won by the lowest index: BLOB5's 1st point.
    # 1-1-1 vote -> -1 (smallest label); size = the 2 stored noise points.
    pred = predict_labels(STORE, labels, E[3][None])
    assert pred.tolist() == [-1]
    assert cluster_sizes(labels, pred).tolist() == [2]
    assert cluster_sizes(labels, pred, noise_is_cluster=False).tolist() == [0]


def test_empty_memory_gives_noise_size_zero_penalty_zero():
    pred = predict_labels(np.zeros((0, 4)), np.zeros(0, np.int64), np.ones((3, 4)))
    assert pred.tolist() == [-1, -1, -1]
    sizes = cluster_sizes(np.zeros(0, np.int64), pred)
    assert sizes.tolist() == [0, 0, 0]
    assert meds_penalty(sizes, alpha=0.1).tolist() == [0.0, 0.0, 0.0]


def unit(deg):
    return np.array([math.cos(math.radians(deg)), math.sin(math.radians(deg))])


def test_vote_ties_go_to_the_smallest_label():
    stored = np.stack([unit(0), unit(10), unit(20), unit(90)])
    q = unit(10)[None]
    assert predict_labels(stored, np.array([-1, 0, 3, 5]), q).tolist() == [-1]  # 1-1-1, noise
    assert predict_labels(stored, np.array([2, 0, 5, 7]), q).tolist() == [0]  # 1-1-1
    assert predict_labels(stored, np.array([4, 4, 0, 7]), q).tolist() == [4]  # 2-1 majority
    assert predict_labels(stored, np.array([1, 1, 0, 0]), q, k=4).tolist() == [0]  # 2-2


def test_equal_distances_are_broken_by_lower_index():
    v = np.array([[1.0, 2.0, 3.0]])
    stored = np.concatenate([v, v, v, [[-1.0, 0.0, 0.0]]])
    assert predict_labels(stored, np.array([9, 8, 7, 0]), v, k=1).tolist() == [9]
    assert predict_labels(stored, np.array([9, 8, 7, 0]), v, k=2).tolist() == [8]  # 9 vs 8 tie
    # a larger store (an unstable sort reorders equal keys there): 30 copies of v among 30 of w
    is_v = np.random.default_rng(9).permutation(np.repeat([True, False], 30))  # first v: row 4
    stored = np.where(is_v[:, None], v, [[-1.0, 0.0, 0.0]])
    labels = np.arange(60)[::-1].copy()  # lower index = larger label
    first_v = int(np.flatnonzero(is_v)[0])
    assert predict_labels(stored, labels, v, k=1).tolist() == [labels[first_v]]


def test_cosine_not_euclidean_and_scale_invariant():
    stored = np.array([[1.0, 0.0], [10.0, 1.0]])
    lab = np.array([0, 1])
    q = np.array([[5.0, 0.6]])  # angle 6.8 deg: nearer (10,1) at 5.7 deg; Euclidean nearer (1,0)
    for scale in (1.0, 10.0, 0.1):
        assert predict_labels(stored, lab, q * scale, k=1).tolist() == [1]


def test_k_larger_than_the_store_uses_all():
    stored = np.stack([unit(0), unit(5)])
    assert predict_labels(stored, np.array([3, 3]), unit(1)[None], k=3).tolist() == [3]
    assert predict_labels(stored, np.array([1, 0]), unit(1)[None], k=3).tolist() == [0]


def test_cluster_sizes_counts_stored_labels():
    stored = np.array([0, 0, 0, 1, -1, -1])
    pred = np.array([0, 1, -1, 2])
    assert cluster_sizes(stored, pred).tolist() == [3, 1, 2, 0]
    assert cluster_sizes(stored, pred, noise_is_cluster=False).tolist() == [3, 1, 0, 0]
    assert single_cluster_sizes(7, 3).tolist() == [7, 7, 7]
    assert single_cluster_sizes(0, 2).tolist() == [0, 0]


def test_normalize_rows_keeps_zero_rows():
    out = normalize_rows(np.array([[3.0, 4.0], [0.0, 0.0]]))
    assert out.tolist() == [[0.6, 0.8], [0.0, 0.0]]


def test_top1_eigen_ratio():
    assert top1_eigen_ratio(np.array([[1, 0], [-1, 0], [0, 1], [0, -1]])) == pytest.approx(0.5)
    # cov = diag(2/3, 8/3) -> 0.8
    assert top1_eigen_ratio(np.array([[1, 0], [-1, 0], [0, 2], [0, -2]])) == pytest.approx(0.8)
    assert top1_eigen_ratio(np.array([[1, 2], [2, 4], [3, 6]])) == pytest.approx(1.0)
    assert math.isnan(top1_eigen_ratio(np.ones((1, 3))))
    assert math.isnan(top1_eigen_ratio(np.ones((4, 3))))


def test_dedup_fits_the_distinct_rows_and_labels_every_copy():
    """One step's identical responses are one point: three copies of a row no longer make a
    dense cluster of their own, and each copy gets its distinct row's label."""
    from medsrl.features.clustering import distinct_rows

    rng = np.random.default_rng(0)
    a, b, c = np.eye(6)[0], np.eye(6)[1], np.eye(6)[2]
    near = [v + 0.01 * rng.standard_normal(6) for v in (b, b, b, c, c, c)]
    x = np.stack([a, a, a, *near])
    first, owner = distinct_rows(x)
    assert first.tolist() == [0, 3, 4, 5, 6, 7, 8] and owner.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6]
    plain = fit_cluster_labels(x)
    deduped = fit_cluster_labels(x, dedup=True)
    assert plain[0] == plain[1] == plain[2] != -1  # the copies form a cluster of their own
    assert (deduped[:3] == -1).all()  # one point alone: noise
    assert len(set(deduped[3:6].tolist())) == 1 and deduped[3] != -1 and deduped[6] != deduped[3]
