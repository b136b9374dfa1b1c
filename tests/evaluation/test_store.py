import json

import pytest

from medsrl.evaluation.store import GenerationStore, settings_fingerprint


def rec(i, run="r", bench="b"):
    return {"run": run, "benchmark": bench, "index": i, "responses": [{"score": 1.0}]}


def test_records_round_trip_and_survive_reopening(tmp_path):
    path = tmp_path / "g.jsonl"
    with GenerationStore(path) as store:
        store.add(rec(0), "f1")
        store.add(rec(1), "f1")
    with GenerationStore(path) as store:
        assert store.lookup("r", "b", 1, "f1")["responses"] == [{"score": 1.0}]
        assert store.lookup("r", "b", 2, "f1") is None
        assert store.lookup("other", "b", 0, "f1") is None


def test_torn_last_line_is_dropped_and_truncated(tmp_path):
    path = tmp_path / "g.jsonl"
    with GenerationStore(path) as store:
        store.add(rec(0), "f")
    with open(path, "a") as f:
        f.write(json.dumps(rec(1))[:20])  # a kill in the middle of a write
    with GenerationStore(path) as store:
        assert store.dropped_lines == 1
        assert store.lookup("r", "b", 1, "f") is None
        store.add(rec(1), "f")
    lines = path.read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1]


def test_damage_before_the_last_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(
        json.dumps({**rec(0), "settings": "f"})
        + "\n{oops\n"
        + json.dumps({**rec(1), "settings": "f"})
        + "\n"
    )
    with pytest.raises(ValueError, match="g.jsonl:2"):
        GenerationStore(path)


def test_other_settings_are_refused(tmp_path):
    path = tmp_path / "g.jsonl"
    with GenerationStore(path) as store:
        store.add(rec(0), settings_fingerprint({"n": 4}))
    with GenerationStore(path) as store, pytest.raises(ValueError, match="other settings"):
        store.lookup("r", "b", 0, settings_fingerprint({"n": 8}))


def test_fingerprint_is_order_independent_and_sensitive():
    assert settings_fingerprint({"a": 1, "b": 2}) == settings_fingerprint({"b": 2, "a": 1})
    assert settings_fingerprint({"a": 1}) != settings_fingerprint({"a": 2})
