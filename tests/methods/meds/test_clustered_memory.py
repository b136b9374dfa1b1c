"""The memory with its re-fits: when a store is re-fitted (``refit_growth``), and what it holds."""

from __future__ import annotations

import numpy as np
import pytest

from medsrl.features.clustering import fit_cluster_labels
from medsrl.methods.meds.clustered_memory import ClusteredMemory

STORE = [("p", False)]


def _rows(rng, m):
    return [(STORE * m, rng.normal(size=(m, 3)).astype(np.float32))]


def _fitted(mem):
    entry = mem.memory.get("p", False)
    return entry.fitted_upto, len(entry)


def test_every_add_refits_by_default():
    rng, mem = np.random.default_rng(0), ClusteredMemory(refit="sync")
    for m in (4, 1, 2):
        mem.insert(_rows(rng, m), step=0)
        upto, n = _fitted(mem)
        assert upto == n
    entry = mem.labels_for("p", False)
    assert np.array_equal(entry.labels, fit_cluster_labels(entry.features, min_cluster_size=2, min_samples=1))


def test_a_store_refits_once_it_grew_by_the_fraction():
    rng, mem = np.random.default_rng(0), ClusteredMemory(refit="sync", refit_growth=0.5)
    mem.insert(_rows(rng, 8), step=0)
    assert _fitted(mem) == (8, 8)  # nothing fitted yet: any add is growth enough
    mem.insert(_rows(rng, 3), step=1)
    assert _fitted(mem) == (8, 11)  # 3 < 0.5 x 8: the new rows wait, unlabelled
    entry = mem.labels_for("p", False)
    assert (entry.labels[8:] == -1).all()
    assert np.array_equal(entry.fitted_labels,
                          fit_cluster_labels(entry.features[:8], min_cluster_size=2, min_samples=1))
    mem.insert(_rows(rng, 1), step=2)
    assert _fitted(mem) == (12, 12)  # 4 >= 4: re-fit over all rows


def test_with_a_cap_the_fitted_rows_move_out_first_and_the_growth_counts_the_new_ones():
    rng, mem = np.random.default_rng(0), ClusteredMemory(cap_per_key=8, refit="sync", refit_growth=0.5)
    mem.insert(_rows(rng, 8), step=0)
    mem.insert(_rows(rng, 2), step=1)  # the 2 oldest out: 6 fitted rows left, 2 new
    assert _fitted(mem) == (6, 8)
    mem.insert(_rows(rng, 2), step=2)  # 4 new >= 0.5 x 4 fitted
    assert _fitted(mem) == (8, 8)


def test_a_negative_growth_is_refused():
    with pytest.raises(ValueError, match="refit_growth"):
        ClusteredMemory(refit_growth=-0.1)
