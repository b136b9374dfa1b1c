"""ErrorMemory: per-key stores, cap, labels, exact state round trip, atomic snapshots."""

import io
import os

import numpy as np
import pytest
import torch

from medsrl.methods.meds.error_memory import ErrorMemory, load_snapshot
from medsrl.utils import columnar


def rows(start, n, d=3):
    """Rows whose first value is their global index, so alignment is visible."""
    x = np.zeros((n, d), np.float32)
    x[:, 0] = np.arange(start, start + n)
    x[:, 1] = 0.5
    return x


def filled() -> ErrorMemory:
    mem = ErrorMemory()
    mem.add("p1", False, rows(0, 3), step=1)
    mem.add("p1", True, rows(100, 2), step=1)
    mem.add("p2", False, rows(200, 4), step=2)
    mem.set_labels("p1", False, np.array([0, 0, -1]))
    mem.add("p1", False, rows(3, 2), step=3)
    return mem


def test_add_get_and_counts():
    mem = filled()
    e = mem.get("p1", False)
    assert e.features[:, 0].tolist() == [0, 1, 2, 3, 4] and e.features.dtype == np.float32
    assert e.steps.tolist() == [1, 1, 1, 3, 3] and e.steps.dtype == np.int64
    assert e.labels.tolist() == [0, 0, -1, -1, -1] and e.fitted_upto == 3
    assert e.fitted_labels.tolist() == [0, 0, -1] and len(e.fitted_features) == 3
    assert mem.get("p1", True).features[:, 0].tolist() == [100, 101]
    assert mem.get("p3", False) is None
    assert mem.keys() == [("p1", False), ("p1", True), ("p2", False)]
    assert mem.num_keys() == 3 and mem.num_entries() == 11 and mem.dim == 3
    mem.reset()
    assert mem.num_keys() == 0 and mem.num_entries() == 0 and mem.dim is None


def test_stored_arrays_are_read_only():
    e = filled().get("p1", False)
    with pytest.raises(ValueError):
        e.features[0, 0] = 9


def test_mixed_dims_name_the_key():
    mem = filled()
    with pytest.raises(ValueError, match="'p1'"):
        mem.add("p1", False, rows(0, 1, d=4), step=4)
    with pytest.raises(ValueError, match="'p9'"):
        mem.add("p9", True, rows(0, 1, d=2), step=4)
    with pytest.raises(ValueError, match="'p1'"):
        mem.add("p1", False, np.ones(3, np.float32), step=4)  # not [m, D]
    with pytest.raises(ValueError, match="NaN"):
        mem.add("p1", False, np.full((1, 3), np.nan, np.float32), step=4)


def test_set_labels_checks():
    mem = filled()
    with pytest.raises(KeyError):
        mem.set_labels("nope", False, np.array([0]))
    with pytest.raises(ValueError):
        mem.set_labels("p1", False, np.zeros(6, np.int64))  # more labels than rows
    mem.set_labels("p1", False, np.array([1, 1, 2, 2]))
    e = mem.get("p1", False)
    assert e.labels.tolist() == [1, 1, 2, 2, -1] and e.fitted_upto == 4


def test_cap_drops_oldest_and_keeps_steps_and_labels_aligned():
    mem = ErrorMemory(cap_per_key=5)
    mem.add("p", False, rows(0, 3), step=1)
    mem.set_labels("p", False, np.array([7, 7, 8]))
    mem.add("p", False, rows(3, 4), step=2)  # 7 rows -> the 2 oldest go
    e = mem.get("p", False)
    assert e.features[:, 0].tolist() == [2, 3, 4, 5, 6]
    assert e.steps.tolist() == [1, 2, 2, 2, 2]
    assert e.labels.tolist() == [8, -1, -1, -1, -1] and e.fitted_upto == 1
    mem.add("p", False, rows(7, 6), step=3)  # more than the cap at once
    e = mem.get("p", False)
    assert e.features[:, 0].tolist() == [8, 9, 10, 11, 12]
    assert e.steps.tolist() == [3] * 5 and e.labels.tolist() == [-1] * 5 and e.fitted_upto == 0


def assert_same(a: ErrorMemory, b: ErrorMemory):
    assert a.keys() == b.keys() and a.dim == b.dim
    for key in a.keys():
        ea, eb = a.get(*key), b.get(*key)
        for name in ("features", "steps", "labels"):
            x, y = getattr(ea, name), getattr(eb, name)
            assert x.dtype == y.dtype and np.array_equal(x, y), (key, name)
        assert ea.fitted_upto == eb.fitted_upto


def test_state_dict_round_trip_is_exact_through_torch_save():
    mem = filled()
    mem.add("p2", False, np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32), step=9)
    buf = io.BytesIO()
    torch.save({"mem": mem.state_dict()}, buf)
    buf.seek(0)
    back = ErrorMemory()
    back.load_state_dict(torch.load(buf, weights_only=False)["mem"])
    assert_same(mem, back)
    buf = io.BytesIO()  # tensor form survives torch.load's default weights_only=True
    torch.save({"mem": mem.state_dict(as_tensors=True)}, buf)
    buf.seek(0)
    back = ErrorMemory()
    back.load_state_dict(torch.load(buf)["mem"])
    assert_same(mem, back)


def test_state_dict_is_a_copy_and_validated():
    mem = filled()
    state = mem.state_dict()
    state["entries"][0]["features"][0, 0] = 42
    assert mem.get("p1", False).features[0, 0] == 0
    state = mem.state_dict()
    state["entries"][2]["labels"] = state["entries"][2]["labels"][:-1]
    with pytest.raises(ValueError, match="'p2'"):
        ErrorMemory().load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        ErrorMemory().load_state_dict({"entries": []})
    empty = ErrorMemory()
    back = ErrorMemory()
    back.load_state_dict(empty.state_dict())
    assert back.num_keys() == 0


def test_snapshot_round_trip_and_plain_numpy_access(tmp_path):
    mem = ErrorMemory(cap_per_key=10)
    full = filled()
    for k in full.keys():
        v = full.get(*k)
        mem.add(k[0], k[1], v.features, step=int(v.steps[0]))
        mem.set_labels(k[0], k[1], v.labels[: v.fitted_upto])
    path = mem.snapshot(tmp_path / "mem.npz")
    back = load_snapshot(path)
    assert_same(mem, back)
    assert back.cap_per_key == 10
    import json

    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        keys = np.array(meta["keys"])[z["store"]]
        assert keys.tolist() == ["p1"] * 5 + ["p1"] * 2 + ["p2"] * 4
        assert z["correct"].tolist() == [False] * 5 + [True] * 2 + [False] * 4
        assert z["features"].shape == (11, 3) and z["features"].dtype == np.float32
        assert z["label"][:5].tolist() == [0, 0, -1, -1, -1]
    empty = ErrorMemory().snapshot(tmp_path / "empty.npz")
    assert load_snapshot(empty).num_keys() == 0


def test_snapshot_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "mem.npz"
    first = filled()
    first.snapshot(path)
    second = filled()
    second.add("p3", True, rows(300, 2), step=5)

    def broken_writer(f, arrays):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(columnar, "_write_npz", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        second.snapshot(path)
    assert os.listdir(tmp_path) == ["mem.npz"]  # no temp file left behind
    assert_same(load_snapshot(path), first)  # the previous snapshot is intact
    monkeypatch.undo()
    second.snapshot(path)
    assert_same(load_snapshot(path), second)
