"""D1, the memory audit (``studies.audit``): its stores, replay and figures on hand-made
features and answers, its feature readers on a tiny random model, and one small end-to-end run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from studies.audit import (
    ANSWER_FEATURE,
    STORES,
    AnswerMemory,
    AuditSettings,
    FeatureMemory,
    Samples,
    StoreSpec,
    all_variants,
    markdown_table,
    recurring_share,
    replay,
    twin_share,
    variant_figures,
)

STORE = {st.name: st for st in STORES}


def _drifting_duplicates(visits: int = 3, copies: int = 4, seed: int = 0) -> Samples:
    """One trap prompt whose wrong answer ``14`` comes back at every visit as ``copies`` responses
    with one text (bit-identical features) that the update moves a little each visit, plus two
    one-off wrong answers far away and a right one: the pattern the audit suspects."""
    rng = np.random.default_rng(seed)
    visit, correct, answers, texts, feats = [], [], [], [], []
    for v in range(visits):
        dup = np.array([1.0, 0.2 * v, 0.0, 0.0])  # moved by every update, the same within a visit
        rows = [(dup, "14", f"3 + 4 = 7. 7 * 2 = 14. \\boxed{{14}} v{v}", False)] * copies
        rows += [(np.array([0.0, 0.0, 1.0, 0.0]) + 0.3 * rng.normal(size=4), str(20 + 2 * v + j), f"odd {v} {j}", False)
                 for j in range(2)]
        rows += [(np.full(4, np.nan), "11", "4 * 2 = 8. 3 + 8 = 11. \\boxed{11}", True)]
        for f, a, t, ok in rows:
            visit.append(v)
            correct.append(ok)
            answers.append(a)
            texts.append(t)
            feats.append(f)
    n = len(visit)
    return Samples(np.array(visit), np.zeros(n, dtype=int), np.array(correct), answers, texts,
                   {"reference": np.asarray(feats, dtype=np.float32)}, ["Compute 3 + 4 * 2."])


def test_duplicates_make_single_visit_clusters_while_the_answer_memory_counts_recurrence():
    samples, s = _drifting_duplicates(), AuditSettings()
    ref = replay(samples, "reference", STORE["reference"], s)
    ans = replay(samples, ANSWER_FEATURE, STORE["answer"], s)
    is14 = np.array([a == "14" for a in samples.answers])
    by_visit = lambda rep: [sorted(set(rep.sizes[is14 & (samples.visit == v)].tolist())) for v in range(3)]  # noqa: E731
    # the answer-keyed memory counts every earlier 14: 0, 4, 8
    assert by_visit(ans) == [[0], [4], [8]]
    # the feature memory meets each visit's copies as a new cluster of the last visit's copies:
    # the size stays 4 however often 14 came back
    assert by_visit(ref) == [[0], [4], [4]]
    # after the last visit: one cluster per visit's copies, and the scattered one-offs of every
    # visit together in a fourth (they are near each other, far from 14's direction)
    clusters = sorted(ref.memories[0].cluster_visits(), key=len)
    assert [sorted(set(c)) for c in clusters[:3]] == [[0], [1], [2]] and [len(c) for c in clusters] == [4, 4, 4, 6]
    figs = variant_figures(samples, "reference", STORE["reference"], s)
    assert figs["single_visit_share"] == 0.75 and figs["visits_per_cluster"] == 1.5
    assert figs["clusters_per_prompt"] == 4
    assert figs["twin_share"] == pytest.approx(4 / 6)  # the copies; the one-offs are alone
    assert figs["recurring_share"] == 0.0  # no vector comes back at a later visit
    assert figs["text_recurring_share"] == 0.0
    answer = variant_figures(samples, ANSWER_FEATURE, STORE["answer"], s)
    assert answer["G4"] == pytest.approx(1.0)  # its size is the earlier count by construction
    assert answer["clusters_per_prompt"] == 1 and answer["visits_per_cluster"] == 3.0
    assert "twin_share" not in answer


def test_dedup_store_is_the_plugins_dedup():
    """``dedup`` keeps every row (sizes count copies) and clusters the distinct ones, exactly as
    ``fit_cluster_labels(dedup=True)``, the function ``meds.clustering.dedup`` re-fits with."""
    from medsrl.features.clustering import fit_cluster_labels

    samples, s = _drifting_duplicates(), AuditSettings()
    rep = replay(samples, "reference", STORE["dedup"], s)
    mem = rep.memories[0]
    assert len(mem) == len(mem.ids) and len(mem) > len({tuple(r) for r in mem.rows})  # copies kept
    assert (mem.labels == fit_cluster_labels(np.stack(mem.rows), dedup=True)).all()
    is14 = np.array([a == "14" for a in samples.answers])
    # the visit-2 copies fall in the visit-1 rows' cluster (or noise): a size of at least their 4
    assert (rep.sizes[is14 & (samples.visit == 1)] >= 4).all()


def test_min_samples_store_leaves_a_small_store_all_noise():
    mem = FeatureMemory(min_samples=3)
    x = np.array([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0]])
    mem.add(0, x, ["a", "b", "c"], ["1", "2", "3"], [0, 1, 2])
    assert (mem.labels == -1).all() and mem.cluster_visits() == []
    sizes, labels = mem.sizes(np.array([[1.0, 0.0]]), ["1"])
    assert sizes.tolist() == [3] and labels.tolist() == [-1]  # noise counts as one cluster


def test_answer_memory_sizes_labels_and_clusters():
    mem = AnswerMemory()
    assert mem.sizes(None, ["5", None])[0].tolist() == [0, 0]
    mem.add(0, None, ["t"] * 4, ["5", "5", "7", None], [0, 1, 2, 3])
    mem.add(1, None, ["t"] * 2, ["7", "9"], [4, 5])
    sizes, labels = mem.sizes(None, ["5", "7", "9", "8", None])
    assert sizes.tolist() == [2, 2, 1, 0, 0] and labels.tolist() == [0, 1, 2, -1, -1]
    assert mem.cluster_visits() == [[0, 0], [0, 1]]  # 5 and 7; 9 was given once
    assert mem.row_labels() == {0: 0, 1: 0, 2: 1, 4: 1, 5: -1}
    assert mem.noise_share() == pytest.approx(1 / 5)


def test_twin_and_recurring_shares():
    keys = ["a", "a", "b", "a", "c", "c"]
    visit = np.array([0, 0, 0, 1, 1, 1])
    prompt = np.array([0, 0, 0, 0, 0, 1])
    assert twin_share(keys, visit, prompt) == pytest.approx(2 / 6)  # the two a's of visit 0
    # distinct per prompt: (0,a) recurs; (0,b), (0,c), (1,c) do not
    assert recurring_share(keys, visit, prompt) == pytest.approx(1 / 4)
    assert twin_share([], visit[:0], prompt[:0]) is None


def test_gate_figures_on_a_hand_made_replay():
    """Two prompts, two visits. Prompt 0 repeats 14 and the feature store finds the copies'
    cluster: its penalty is largest on the most frequent wrong answer (G3 > 0)."""
    samples, s = _drifting_duplicates(visits=2), AuditSettings()
    figs = variant_figures(samples, "reference", STORE["reference"], s)
    assert figs["G1"] == 1.0  # visit 1: the copies (size 4) and the one-offs carry other penalties
    assert figs["G3"] > 0 and len(figs["G3_per_visit"]) == 1


def test_all_variants_and_table():
    pairs = all_variants(["reference", "digits"])
    assert [(f, st.name) for f, st in pairs][-1] == (ANSWER_FEATURE, "answer")
    assert len(pairs) == 2 * 4 + 1
    md = markdown_table([{"feature": "reference", "store": "reference", "G1": 0.5, "G3": None}], routes=False)
    lines = md.splitlines()
    assert lines[0].startswith("**G1**") and lines[2].startswith("| feature | store | G1 | G3 | G4")
    assert lines[4].startswith("| reference | reference | 0.500 | — |")


def test_mixed_groups_only_drops_groups_without_a_right_response():
    samples = _drifting_duplicates(visits=1)
    samples.correct[:] = False  # every response wrong (the right one has no feature anyway)
    assert samples.usable("reference").sum() == 6
    assert samples.usable("reference", mixed_groups_only=True).sum() == 0


# ------------------------------------------------------------------ on a tiny random model

TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, max_position_embeddings=512)


def test_feature_readers_agree_with_the_plugins_reference_feature():
    import torch
    from studies.audit import FEATURES, AuditFeatureReader

    from medsrl.features.reader import digit_token_ids
    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.models.tiny import build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(**TINY).eval()
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    p1 = enc("<|im_start|>user\nCompute 3 + 4 * 2.<|im_end|>\n<|im_start|>assistant\n")
    p2 = enc("<|im_start|>user\nEvaluate 9 - 4 * 2.<|im_end|>\n<|im_start|>assistant\n")
    end = enc("<|im_end|>")
    r1, r2, r3 = (enc("7 * 2 = 14. \\boxed{14}") + end, enc("8. \\boxed{11}") + end, enc("no box") + end)
    with torch.no_grad():
        out = AuditFeatureReader(model, tok, list(FEATURES)).read([p1, p1, p2, p1], [r1, r1, r2, r3], tok.pad_token_id)
    ref = out["reference"]
    assert ref.shape == (4, 3) and out["diff"].shape == (4, 2) and out["digits"].shape == (4, 30)
    assert out["two_tokens"].shape == (4, 6)
    assert np.isnan(ref[3]).all() and all(np.isnan(x[3]).all() for x in out.values())  # no box
    assert (ref[0] == ref[1]).all() and (out["digits"][0] == out["digits"][1]).all()  # same text, same bits
    one = digit_token_ids(tok).index(enc("1")[0])  # the first answer token of both 14 and 11
    for i in range(3):
        np.testing.assert_allclose(out["digits"][i].reshape(3, 10)[:, one], ref[i], atol=1e-6)
        assert (out["two_tokens"][i, :3] == ref[i]).all()
    assert (out["bf16"][:3] == torch.from_numpy(ref[:3]).bfloat16().float().numpy()).all()


def _tiny_run(tmp_path):
    """A run directory as training leaves it (config + two checkpoints) and a warm start."""
    import torch
    from omegaconf import OmegaConf

    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.models.tiny import build_tiny_model

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    cfg = {"model": {"name_or_path": None, "tokenizer": "char", "dtype": "float32", "tiny": TINY},
           "rollout": {"temperature": 1.0, "max_new_tokens": 24}, "study": {"pool_l1": 32}}
    OmegaConf.save(OmegaConf.create(cfg), run / ".hydra" / "config.yaml")
    warm = tmp_path / "warm"
    build_tiny_model(seed=0, **TINY).save_pretrained(warm)
    build_char_tokenizer().save_pretrained(warm)
    for step, seed in ((2, 1), (4, 2)):
        state = {f"policy.{k}": v for k, v in build_tiny_model(seed=seed, **TINY).state_dict().items()}
        torch.save({"state_dict": state, "global_step": step}, run / "checkpoints" / f"step_{step:06d}.ckpt")
    torch.save({"state_dict": state, "global_step": 4}, run / "checkpoints" / "last.ckpt")
    return run, warm


def test_end_to_end_on_a_tiny_random_run(tmp_path, capsys):
    from studies.audit import run_audit

    run, warm = _tiny_run(tmp_path)
    s = AuditSettings(run=str(run), warm_start=str(warm), visits=2, n=3, traps=2, others=1, max_checkpoints=2)
    result = run_audit(s)
    assert (result["settings"]["max_new_tokens"], result["settings"]["temperature"]) == (24, 1.0)  # the run's
    out = run / "audit"
    assert [c["step"] for c in result["checkpoints"]] == [0, 2]
    assert result["responses"] == 2 * 2 * 3 * 3
    saved = json.loads((out / "audit.json").read_text())
    assert len(saved["variants"]) == len(all_variants(s.features)) and saved["settings"]["n"] == 3
    assert (out / "audit.md").read_text().count("\n| ") == len(saved["variants"]) + 1
    assert "[audit] checkpoint 2/2 (step 2), visit 2/2" in capsys.readouterr().out
    # a second call reads the cache: the same samples, no sampling
    again = run_audit(AuditSettings(run=str(run), warm_start=str(warm), visits=2, n=3, traps=2, others=1,
                                    max_new_tokens=24, max_checkpoints=2))
    assert "cached" in capsys.readouterr().out and again["visits"] == result["visits"]
    with pytest.raises(SystemExit, match="lacks step000004_visit0.npz"):  # step 4 was never sampled
        run_audit(AuditSettings(run=str(run), warm_start=str(warm), visits=2, n=3, traps=2, others=1),
                  report_only=True)
    with pytest.raises(SystemExit, match="other sampling"):
        run_audit(AuditSettings(run=str(run), warm_start=str(warm), visits=2, n=4, traps=2, others=1,
                                max_new_tokens=24, max_checkpoints=2))


def test_checkpoints_in_step_order_without_last_duplicate(tmp_path):
    from studies.audit import find_checkpoints

    run, _ = _tiny_run(tmp_path)
    assert [(step, p.name) for step, p in find_checkpoints(run)] == [(2, "step_000002.ckpt"), (4, "step_000004.ckpt")]


def test_store_spec_names_are_unique():
    assert len({st.name for st in STORES}) == len(STORES)
    assert StoreSpec("x").kind == "features"


def test_the_stores_clusters_are_scored_against_routes():
    from studies.audit import response_routes

    samples, s = _drifting_duplicates(), AuditSettings()
    routes = response_routes(samples)
    assert routes[0] == "shortcut" and routes[6] == "correct"
    figs = variant_figures(samples, ANSWER_FEATURE, STORE["answer"], s, routes)
    # the answer store's one cluster is the 14s, all of them the shortcut's: pure
    assert figs["routes"]["purity"] == 1.0
    md = markdown_table([figs], routes=True)
    assert "route purity" in md and "route groups" not in md


def test_recurrence_and_cluster_spans_by_checkpoint():
    """Two visits per checkpoint share weights: the copies' features recur within a checkpoint
    (and their clusters span both visits) but not across checkpoints."""
    from studies.audit import cluster_figures, feature_figures

    samples = _drifting_duplicates(visits=4)
    samples.visits_per_checkpoint = 2
    x = samples.features["reference"]
    x[samples.visit == 1] = x[samples.visit == 0]  # visit 1 re-samples checkpoint 0: same features
    x[samples.visit == 3] = x[samples.visit == 2]
    for i in np.flatnonzero(samples.visit % 2 == 1):
        samples.texts[i] = samples.texts[i - 7]  # and the same texts
    figs = feature_figures(samples, "reference")
    assert figs["recurring_share"] == 0.0 and figs["recurring_same_weights_share"] == 1.0
    assert figs["text_recurring_share"] == 0.0 and figs["text_recurring_same_weights_share"] == 1.0
    rep = replay(samples, "reference", STORE["reference"], AuditSettings())
    clusters = cluster_figures(rep.memories, samples.visits_per_checkpoint)
    assert clusters["single_checkpoint_share"] >= clusters["single_visit_share"]
    assert clusters["checkpoints_per_cluster"] <= clusters["visits_per_cluster"]


def _audit(*rows):
    return {"variants": [dict(zip(("feature", "store", "G3", "G4"), r, strict=True)) for r in rows]}


DIFF_DEDUP = ["algorithm.plugins.meds.features.diff=true", "algorithm.plugins.meds.clustering.dedup=true"]


def test_d1_rule_takes_the_best_feature_memory_or_else_the_answer_keyed_one():
    from studies.audit import chosen_memory as choose

    assert (choose(_audit(("reference", "reference", 0.01, 0.05), ("-", "answer", 0.3, 1.0)))
            == ("answer", ["algorithm.plugins.meds.clustering.mode=answer"]))
    rows = [("reference", "reference", 0.02, 0.35), ("diff", "dedup", 0.05, 0.5), ("bf16", "reference", -0.1, 0.8)]
    assert choose(_audit(*rows)) == ("diff feature, dedup store", DIFF_DEDUP)
    with pytest.raises(SystemExit, match="not a MEDS plug-in setting"):
        choose(_audit(("two_tokens", "reference", 0.1, 0.6)))


def test_d2s_memory_is_chosen_once_and_kept(tmp_path):
    from studies.audit import kept_memory

    (tmp_path / "v3_d1" / "audit").mkdir(parents=True)
    audit = tmp_path / "v3_d1" / "audit" / "audit.json"
    audit.write_text(json.dumps(_audit(("diff", "dedup", 0.05, 0.5))))
    assert kept_memory(tmp_path / "v3_d1") == ("diff feature, dedup store", DIFF_DEDUP)
    audit.write_text(json.dumps(_audit(("bf16", "reference", 0.05, 0.9))))  # a later audit
    assert kept_memory(tmp_path / "v3_d1")[0] == "diff feature, dedup store"
