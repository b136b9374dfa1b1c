"""ResponseHistory: cap, recency order, visits, exact state and snapshot round trips, digest."""

import io
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from medsrl.methods.r3.history import ResponseHistory, StoredResponse, load_snapshot
from medsrl.utils import columnar


def resp(step, correct=True, text="", reward=None, ids=(1, 2), logprobs=None, **kw):
    fields = {
        "token_ids": ids,
        "text": text or f"s{step}",
        "reward": (1.0 if correct else 0.0) if reward is None else reward,
        "correct": correct,
        "step": step,
        "finish_reason": "stop",
        "extracted": "42" if correct else "7",
        "has_box": True,
        "logprobs": logprobs,
    }
    return StoredResponse(**{**fields, **kw})


def filled(last_logprob=-0.01) -> ResponseHistory:
    """Every awkward value: None logprobs/extracted, unicode, empty tokens, a capped key."""
    h = ResponseHistory(cap_per_key=3)
    h.add("p1", resp(1, ids=(5, 6, 7), logprobs=(-0.1, -0.2, -1.0 / 3.0), reward=0.9))
    h.add("p1", resp(1, False, text="ünïcødé ∑ 🙂", extracted=None, has_box=False))
    h.add("p2", resp(2, ids=(), logprobs=(), text="", finish_reason="length", reward=-0.25))
    h.add("p1", resp(3, False, ids=(9,), logprobs=(-2.5,)))
    h.add("p1", resp(4, ids=(10, 11), logprobs=(-0.7, last_logprob)))  # drops the first p1 row
    return h


def test_stored_response_checks_and_normalises():
    with pytest.raises(ValueError, match="logprobs has length 1 but token_ids has length 2"):
        resp(1, ids=(1, 2), logprobs=(-0.5,))
    r = resp(1, ids=np.array([3, 4]), logprobs=[0.1, -0.2])
    assert r.token_ids == (3, 4) and type(r.token_ids[0]) is int
    assert r.logprobs == (float(np.float32(0.1)), float(np.float32(-0.2)))  # float32 values
    assert resp(1, ids=()).token_ids == ()


def test_cap_drops_oldest_but_visits_count_steps():
    with pytest.raises(ValueError):
        ResponseHistory(cap_per_key=0)
    h = ResponseHistory(cap_per_key=2)
    for step in (1, 2, 3):
        h.add("p", resp(step))
    assert [r.step for r in h.responses("p")] == [2, 3]
    assert h.visits("p") == 3
    assert h.num_keys() == 1 and h.num_responses() == 2 and "p" in h and "q" not in h
    assert h.responses("q") == [] and h.visits("q") == 0 and h.mean_reward("q") is None


def test_recent_order():
    h = ResponseHistory()
    h.add("p", resp(1, True, "a"))
    h.add("p", resp(3, True, "b"))
    h.add("p", resp(3, False, "c"))
    h.add("p", resp(3, True, "d"))
    h.add("p", resp(5, False, "e"))
    h.add("p", resp(5, True, "f"))
    h.add("p", resp(2, True, "g"))  # added late but sampled earlier: ordered by its step

    def texts(correct, k):
        return [r.text for r in h.recent("p", correct, k)]

    assert texts(True, 10) == ["f", "d", "b", "g", "a"]
    assert texts(True, 2) == ["f", "d"]
    assert texts(False, 5) == ["e", "c"]
    assert texts(True, 0) == [] and texts(True, -1) == [] and h.recent("x", True, 3) == []


def test_mean_reward_visits_keys():
    h = ResponseHistory()
    h.add("b", resp(1, reward=1.0))
    h.add("a", resp(1, reward=0.0))
    h.add("b", resp(1, reward=0.5))  # same step: one visit
    h.add("b", resp(4, reward=-0.3))
    assert h.mean_reward("b") == pytest.approx(0.4)  # (1 + 0.5 - 0.3) / 3
    assert h.visits("b") == 2 and h.visits("a") == 1
    assert h.keys() == ["b", "a"]


def assert_same(a: ResponseHistory, b: ResponseHistory, visits=True):
    assert a.keys() == b.keys() and a.cap_per_key == b.cap_per_key
    for key in a.keys():
        assert a.responses(key) == b.responses(key)
        if visits:
            assert a.visits(key) == b.visits(key)


def test_state_dict_round_trip_through_torch_load_and_digest():
    h = filled()
    buf = io.BytesIO()
    torch.save(h.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["token_ids"].dtype == torch.int64 and state["logprobs"].dtype == torch.float32
    assert state["reward"].dtype == torch.float64 and state["extracted"][0] is None
    back = ResponseHistory(cap_per_key=h.cap_per_key)
    back.load_state_dict(state)
    assert_same(back, h)
    assert back.visits("p1") == 3 and back.visits("p2") == 1
    p1 = back.responses("p1")
    assert p1[0].text == "ünïcødé ∑ 🙂" and p1[0].logprobs is None and p1[0].extracted is None
    assert p1[1].logprobs == (np.float32(-2.5),)
    assert back.responses("p2")[0].token_ids == () and back.responses("p2")[0].logprobs == ()
    assert back.digest() == h.digest()
    # the restored history keeps working like the original (cap, visits)
    for x in (h, back):
        x.add("p1", resp(4, ids=(1,), logprobs=(-0.5,)))
    assert_same(back, h)
    assert back.digest() == h.digest()

    assert filled().digest() == filled().digest()
    assert filled(last_logprob=-0.02).digest() != filled().digest()
    assert filled(last_logprob=np.nextafter(np.float32(-0.01), np.float32(0))).digest() != (
        filled().digest()
    )  # one float32 ulp
    assert ResponseHistory().digest() == ResponseHistory().digest() != filled().digest()


def test_empty_state_round_trip():
    back = ResponseHistory(cap_per_key=4)
    back.load_state_dict(ResponseHistory().state_dict())
    assert back.num_keys() == 0 and back.cap_per_key == 4


def test_a_smaller_cap_on_resume_drops_the_oldest():
    h = ResponseHistory()
    for step in range(4):
        h.add("k", resp(step))
    back = ResponseHistory(cap_per_key=2)
    back.load_state_dict(h.state_dict())
    assert [r.step for r in back.responses("k")] == [2, 3] and back.visits("k") == 4


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.update(format="other"), "not a ResponseHistory state"),
        (lambda s: s.pop("step"), "lacks"),
        (lambda s: s.update(reward=s["reward"][:-1]), "reward has 3 entries, expected 4"),
        (lambda s: s.update(logprobs=s["logprobs"][:-1]), "logprobs"),
        (lambda s: s.update(token_ids=s["token_ids"].int()), "token_ids is int32"),
        (lambda s: s.update(token_offsets=s["token_offsets"][:-1]), "token_offsets"),
        (lambda s: s.update(keys=["p1", "p1"]), "not unique"),
        (lambda s: s.update(text=s["text"][:-1]), "text has 3 entries"),
        (lambda s: s.update(cap_per_key=1), "more than cap_per_key=1"),
        (lambda s: s.update(visits=torch.tensor([1])), "visits has 1 entries, expected 2"),
    ],
)
def test_malformed_state_raises(edit, match):
    state = filled().state_dict()
    edit(state)
    with pytest.raises(ValueError, match=match):
        ResponseHistory().load_state_dict(state)


def test_snapshot_round_trip_and_plain_parquet(tmp_path):
    h = filled()
    path = h.snapshot(tmp_path / "sub" / "history.parquet")
    back = load_snapshot(path)
    assert_same(back, h, visits=False)
    # visits are rebuilt from the stored rows: p1's step-1 correct row was dropped by the cap,
    # but its step-1 wrong row is stored, so all three steps are still seen
    assert back.visits("p1") == 3 and back.visits("p2") == 1

    table = pq.read_table(path)
    assert table.column_names == [
        "key", "step", "correct", "reward", "finish_reason", "extracted", "has_box", "text",
        "token_ids", "logprobs",
    ]  # fmt: skip
    assert table.column("key").to_pylist() == ["p1", "p1", "p1", "p2"]
    assert table.column("token_ids").to_pylist()[2] == [10, 11]
    assert table.column("logprobs").to_pylist()[0] is None
    assert table.column("reward").to_pylist()[3] == -0.25
    assert table.schema.metadata[b"medsrl.cap_per_key"] == b"3"

    empty = ResponseHistory().snapshot(tmp_path / "empty.parquet")
    assert load_snapshot(empty).num_keys() == 0


def test_snapshot_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "history.parquet"
    first = filled()
    first.snapshot(path)
    second = filled()
    second.add("p3", resp(7))

    def broken_writer(f, table):
        f.write(b"PAR1 half a parquet file")
        raise OSError("disk full")

    monkeypatch.setattr(columnar, "_write_parquet", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        second.snapshot(path)
    assert os.listdir(tmp_path) == ["history.parquet"]  # no temp file left behind
    assert_same(load_snapshot(path), first, visits=False)  # the previous snapshot is intact
    monkeypatch.undo()
    second.snapshot(path)
    assert_same(load_snapshot(path), second, visits=False)
