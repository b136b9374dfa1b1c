"""BackgroundRefitter: same labels as the synchronous reference, per-key results, failures."""

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from medsrl.features.clustering import fit_cluster_labels
from medsrl.methods.meds.refit import BackgroundRefitter, RefitError


def blobs(seed: int, n: int = 120, d: int = 14) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 3, (4, d)) + np.linspace(2, 20, d)
    x = centres[rng.integers(0, 4, n)] + rng.normal(0, 0.3, (n, d))
    x[: n // 10] = rng.normal(10, 6, (n // 10, d))  # scattered noise
    return x.astype(np.float32)


FEATURES = {("p", False): blobs(0), ("p", True): blobs(1), ("q", False): blobs(2, n=40)}


def _die_in_worker(features, **kw):
    """Kills a worker process outright (like a segfault); computes normally in the parent."""
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    return fit_cluster_labels(features, **kw)


def test_background_processes_give_the_sync_labels():
    with BackgroundRefitter(mode="sync") as sync:
        for key, x in FEATURES.items():
            sync.submit(key, x)
        ref = sync.drain()
    assert sync.stats["completed"] == 3 and sync.stats["blocked_waits"] == 0
    with BackgroundRefitter(mode="background", num_workers=2) as bg:
        for key, x in FEATURES.items():
            bg.submit(key, x)
        got = {("p", False): bg.wait(("p", False))}
        got.update(bg.drain())
    assert set(got) == set(ref)
    for key in ref:
        assert np.array_equal(got[key], ref[key]) and got[key].dtype == np.int64
        assert np.array_equal(ref[key], fit_cluster_labels(FEATURES[key]))
    assert len(set(ref[("p", False)].tolist()) - {-1}) >= 2  # the data really has clusters


def test_newest_submit_wins_and_results_are_handed_out_once():
    with BackgroundRefitter(executor="thread") as rf:
        rf.submit("k", blobs(3, n=30))
        rf.submit("k", blobs(4, n=50))
        labels = rf.wait("k")
        assert np.array_equal(labels, fit_cluster_labels(blobs(4, n=50)))
        assert rf.wait("k") is None and rf.wait("never") is None
        assert rf.stats["submitted"] == 2 and rf.stats["replaced"] == 1


def test_wait_counts_only_waits_that_block():
    gate = threading.Event()

    def gated_fit(x, **kw):
        gate.wait()
        return fit_cluster_labels(x, **kw)

    with BackgroundRefitter(executor="thread", fit_fn=gated_fit) as rf:
        rf.submit("a", blobs(5, n=20))
        assert not rf.ready("a") and rf.collect() == {}  # collect does not block
        threading.Timer(0.3, gate.set).start()
        assert rf.wait("a") is not None
        assert rf.stats["blocked_waits"] == 1 and rf.stats["blocked_seconds"] >= 0.2
        rf.submit("b", blobs(6, n=20))
        deadline = time.monotonic() + 10
        while not rf.ready("b") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rf.wait("b") is not None
        assert rf.stats["blocked_waits"] == 1  # "b" was done already: not counted
        rf.submit("c", blobs(7, n=20))
        assert set(rf.drain()) == {"c"} and rf.stats["blocked_waits"] == 1


def test_sync_mode_computes_in_submit():
    calls = []

    def counting_fit(x, **kw):
        calls.append(len(x))
        return fit_cluster_labels(x, **kw)

    rf = BackgroundRefitter(mode="sync", fit_fn=counting_fit)
    rf.submit("k", blobs(8, n=25))
    assert calls == [25]
    assert rf.collect().keys() == {"k"} and rf.wait("k") is None
    rf.close()


def test_fit_error_names_the_key():
    bad = blobs(9, n=20)
    bad[4, 2] = np.nan
    with BackgroundRefitter() as rf:  # the error is raised in a worker process
        rf.submit(("prompt-17", False), bad)
        with pytest.raises(RefitError, match="prompt-17"):
            rf.wait(("prompt-17", False))
    with BackgroundRefitter(mode="sync") as rf, pytest.raises(RefitError, match="prompt-18"):
        rf.submit("prompt-18", bad)


def test_dead_worker_falls_back_to_the_main_process_with_a_warning():
    with BackgroundRefitter(fit_fn=_die_in_worker, max_restarts=0) as rf:
        rf.submit("k1", FEATURES[("p", False)])
        rf.submit("k2", FEATURES[("q", False)])
        with pytest.warns(RuntimeWarning) as caught:
            labels = rf.wait("k1")
            rest = rf.drain()
    messages = [str(w.message) for w in caught]
    assert any("died while clustering key 'k1'" in m for m in messages)
    assert any("main process" in m and "max_restarts=0" in m for m in messages)
    assert np.array_equal(labels, fit_cluster_labels(FEATURES[("p", False)]))
    assert np.array_equal(rest["k2"], fit_cluster_labels(FEATURES[("q", False)]))
    assert rf.stats["worker_failures"] >= 1


def test_close_leaves_no_worker_processes():
    rf = BackgroundRefitter(num_workers=2)
    rf.submit("k", FEATURES[("q", False)])
    rf.drain()
    pids = [p.pid for p in multiprocessing.active_children()]
    assert pids  # the workers are children of this process
    rf.close()
    for pid in pids:  # gone, not zombies (signal 0 succeeds on a zombie)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
