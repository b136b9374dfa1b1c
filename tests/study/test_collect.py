"""Reading a study directory: eval rows, per-problem samples, merged TensorBoard curves, gaps.

``build_study`` writes a small synthetic study (also used by ``test_report``): 2 methods x 2
seeds, n = 32 samples on 2 benchmarks, TensorBoard scalars for stages A and B, with stage B of
MEDS seed 1 missing.
"""

import json
import math

import numpy as np
import pytest
from studies.collect import Missing, load_study, merge_curves, read_generations

from medsrl.evaluation.tables import summarize_benchmark, write_json

N = 32
STEPS_A = STEPS_B = 4
BENCHMARKS = {"arith": 6, "gsm": 4}  # name: problems
# correct samples (of 32) per problem, by benchmark; a method adds DELTA[method] + seed
BASE_CORRECT = {"arith": [2, 5, 9, 14, 20, 27], "gsm": [0, 3, 8, 16]}
DELTA = {"dapo": 0, "meds": 4}
WRONG_KINDS = {"dapo": 2, "meds": 4}  # distinct wrong answers per problem (when any are wrong)
# per (method, seed): eigen ratio and wrong clusters written into results.json as given
DIVERSITY = {
    ("dapo", 0): (0.80, 2.0),
    ("dapo", 1): (0.84, 2.5),
    ("meds", 0): (0.70, 3.0),
    ("meds", 1): (0.74, 3.5),
}
# training curves: train/acc per step, val/accuracy every 2 steps (A logs 0..4, B 4..8)
MISSING_STAGE = ("meds", 1, "B")


def train_acc(method, seed, step):
    return 0.3 + 0.01 * step + 0.02 * seed + (0.05 if method == "meds" else 0.0)


def val_acc(method, seed, step, stage):
    return 0.3 + 0.02 * step + 0.01 * seed + (0.001 if stage == "B" else 0.0)


def problem_samples(method, seed, bench, i):
    """(answers, scores) of one problem: the first c answers right, the rest wrong."""
    c = min(N, BASE_CORRECT[bench][i] + DELTA[method] + seed)
    kinds = WRONG_KINDS[method]
    answers = ["42"] * c + [str(100 + (j % kinds)) for j in range(N - c)]
    scores = [1.0] * c + [0.0] * (N - c)
    return answers, scores


def write_events(run_dir, scalars):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for tag, step, value in scalars:
        writer.add_scalar(tag, value, global_step=step)
    writer.close()


def build_study(root, *, torn_line=True):
    root.mkdir(parents=True, exist_ok=True)
    meta = {
        "name": "synthetic",
        "methods": [{"name": "dapo", "label": "DAPO"}, {"name": "meds", "label": "MEDS"}],
        "seeds": [0, 1],
        "steps_a": STEPS_A,
        "steps_b": STEPS_B,
        "eval_n": N,
        "baseline": "dapo",
        "treatment": "meds",
        "commit": "abc1234",
        "machine": "test box (2 CPU cores)",
    }
    (root / "study.json").write_text(json.dumps(meta))
    for method in DELTA:
        for seed in (0, 1):
            for stage, steps in (
                ("A", range(0, STEPS_A)),
                ("B", range(STEPS_A, STEPS_A + STEPS_B)),
            ):
                if (method, seed, stage) == MISSING_STAGE:
                    continue
                run_dir = root / "train" / method / f"seed{seed}" / stage
                first = 0 if stage == "A" else STEPS_A
                vals = range(first, first + STEPS_A + 1, 2)
                scalars = [("train/acc", s, train_acc(method, seed, s)) for s in steps]
                scalars += [("val/accuracy", s, val_acc(method, seed, s, stage)) for s in vals]
                scalars += [("val/distinct_wrong", s, 2.0 + seed) for s in vals]
                if method == "meds":
                    scalars += [("train/meds/top1_eigen_ratio", s, 0.9 - 0.01 * s) for s in steps]
                write_events(run_dir, scalars)
                (run_dir / "summary.json").write_text(json.dumps({"steps": steps[-1] + 1}))
            eval_dir = root / "eval" / method / f"seed{seed}"
            eval_dir.mkdir(parents=True)
            rows, lines = [], []
            run = f"{method}-s{seed}"
            for bench, count in BENCHMARKS.items():
                samples = [problem_samples(method, seed, bench, i) for i in range(count)]
                row = summarize_benchmark(
                    run, bench, [a for a, _ in samples], [s for _, s in samples]
                )
                row["eigen_ratio"], row["wrong_clusters"] = DIVERSITY[(method, seed)]
                rows.append(row)
                for i, (answers, scores) in enumerate(samples):
                    responses = [
                        {
                            "text": f"\\boxed{{{a}}}",
                            "extracted": a,
                            "score": s,
                            "finish_reason": "stop",
                            "timed_out": False,
                            "feature": None,
                        }
                        for a, s in zip(answers, scores, strict=True)
                    ]
                    rec = {
                        "run": run,
                        "benchmark": bench,
                        "index": i,
                        "key": f"{bench}-{i}",
                        "problem": "?",
                        "gold": "42",
                        "responses": responses,
                        "settings": "x",
                    }
                    lines.append(json.dumps(rec))
            write_json(rows, eval_dir / "results.json")  # as medsrl-eval: no average rows
            text = "\n".join(lines) + "\n"
            if torn_line and (method, seed) == ("dapo", 0):
                text += '{"run": "dapo-s0", "benchmark": "arith", "index": 99, "resp'  # killed mid-write
            (eval_dir / "generations.jsonl").write_text(text)
    return root


@pytest.fixture(scope="module")
def study_root(tmp_path_factory):
    return build_study(tmp_path_factory.mktemp("study") / "synthetic")


def test_load_study_rows_and_missing(study_root):
    study = load_study(study_root)
    assert study.name == "synthetic" and study.seeds == [0, 1]
    assert [m.label for m in study.methods] == ["DAPO", "MEDS"]
    assert (study.steps_a, study.steps_b, study.baseline, study.treatment) == (4, 4, "dapo", "meds")
    assert study.missing == [Missing("meds", 1, "train B", "no run directory")]
    assert str(study.missing[0]) == "train B of meds seed 1: no run directory"
    run = study.runs[("dapo", 1)]
    assert [r["benchmark"] for r in run.rows] == ["arith", "gsm"]
    # the summary is the macro average over the two benchmarks
    assert run.summary["benchmark"] == "average"
    assert run.summary["pass@1"] == pytest.approx(
        (run.rows[0]["pass@1"] + run.rows[1]["pass@1"]) / 2
    )
    assert run.summary["eigen_ratio"] == pytest.approx(0.84)
    assert study.runs[("meds", 1)].stages == ("A",)
    assert [r.seed for r in study.evaluated("meds")] == [0, 1]


def test_load_study_problems(study_root):
    study = load_study(study_root)
    problems = study.runs[("dapo", 0)].problems
    assert len(problems) == 10  # the torn last line is dropped
    answers, scores = problem_samples("dapo", 0, "arith", 2)
    assert problems[("arith", 2)].scores == scores
    assert problems[("arith", 2)].answers == answers
    assert not study.notes  # a torn *last* line is normal after a kill, not worth a note


def test_curves_merged_stage_b_wins(study_root):
    study = load_study(study_root)
    steps, values = study.runs[("dapo", 0)].curves["train/acc"]
    assert steps.tolist() == list(range(8))
    assert values == pytest.approx([train_acc("dapo", 0, s) for s in range(8)])
    steps, values = study.runs[("dapo", 1)].curves["val/accuracy"]
    assert steps.tolist() == [0, 2, 4, 6, 8]
    assert values[2] == pytest.approx(val_acc("dapo", 1, 4, "B"))  # B's, not A's
    assert values[1] == pytest.approx(val_acc("dapo", 1, 2, "A"))
    # MEDS seed 1 has stage A only
    steps, _ = study.runs[("meds", 1)].curves["train/meds/top1_eigen_ratio"]
    assert steps.tolist() == [0, 1, 2, 3]
    assert "train/meds/top1_eigen_ratio" not in study.runs[("dapo", 0)].curves


def test_merge_curves():
    a = {
        "x": (np.array([0, 1, 2]), np.array([0.0, 1.0, 2.0])),
        "y": (np.array([0]), np.array([5.0])),
    }
    b = {"x": (np.array([2, 3]), np.array([20.0, 30.0])), "z": (np.array([1]), np.array([7.0]))}
    out = merge_curves(a, b)
    assert out["x"][0].tolist() == [0, 1, 2, 3] and out["x"][1].tolist() == [0.0, 1.0, 20.0, 30.0]
    assert out["y"][1].tolist() == [5.0] and out["z"][1].tolist() == [7.0]
    assert merge_curves({}, {}) == {}


def test_read_generations_damage(tmp_path):
    path = tmp_path / "generations.jsonl"
    good = {"run": "r", "benchmark": "b", "index": 0, "responses": [{"score": 1, "extracted": "1"}]}
    other = {**good, "run": "other", "index": 1}
    path.write_text(json.dumps(good) + "\n{broken\n" + json.dumps(other) + "\n")
    notes = []
    out = read_generations(path, "r", notes)
    assert list(out) == [("b", 0)] and out[("b", 0)].scores == [1.0]
    assert len(notes) == 1 and ":2: not valid JSON" in notes[0]
    before = path.read_bytes()
    path.write_bytes(before + b'{"run": "r", "ind')
    assert len(read_generations(path)) == 2  # torn tail dropped, both runs kept without a filter
    assert path.read_bytes() == before + b'{"run": "r", "ind'  # never truncated by a reader
    assert read_generations(tmp_path / "absent.jsonl") == {}


def test_unfinished_and_absent_parts(tmp_path):
    root = tmp_path / "s"
    (root / "train" / "grpo" / "seed0" / "A" / "tensorboard").mkdir(parents=True)
    (root / "eval" / "grpo" / "seed0").mkdir(parents=True)
    (root / "study.json").write_text(json.dumps({"methods": ["grpo"], "seeds": [0], "steps_a": 3}))
    study = load_study(root)
    assert study.name == "s" and study.runs == {}
    assert [str(m) for m in study.missing] == [
        "train A of grpo seed 0: no TensorBoard events",
        "train B of grpo seed 0: no run directory",
        "eval of grpo seed 0: no results.json (unfinished?)",
    ]
    # with steps_b = 0 there is no stage B to miss
    meta = {"methods": ["grpo"], "seeds": [0], "steps_a": 3, "steps_b": 0}
    (root / "study.json").write_text(json.dumps(meta))
    assert "train B" not in {m.part for m in load_study(root).missing}
    write_events(root / "train" / "grpo" / "seed0" / "A", [("train/acc", 0, 0.5)])
    study = load_study(root)
    assert str(study.missing[0]) == "train A of grpo seed 0: no summary.json (unfinished?)"
    assert study.runs[("grpo", 0)].curves["train/acc"][1].tolist() == [0.5]


def test_without_study_json(tmp_path):
    root = tmp_path / "s"
    (root / "eval" / "r3" / "seed2").mkdir(parents=True)
    (root / "train" / "grpo" / "seed0").mkdir(parents=True)
    study = load_study(root)
    assert [m.name for m in study.methods] == ["grpo", "r3"] and study.seeds == [0, 2]
    assert study.notes and "no study.json" in study.notes[0]
    with pytest.raises(FileNotFoundError):
        load_study(tmp_path / "nowhere")


def test_nan_diversity_stays_nan(tmp_path):
    root = tmp_path / "s"
    eval_dir = root / "eval" / "m" / "seed0"
    eval_dir.mkdir(parents=True)
    (root / "study.json").write_text(json.dumps({"methods": ["m"], "seeds": [0]}))
    rows = [
        {
            "run": "m",
            "benchmark": "b",
            "problems": 1,
            "n": 2,
            "pass@1": 0.5,
            "pass@2": 1.0,
            "eigen_ratio": math.nan,
        }
    ]
    write_json(rows, eval_dir / "results.json")
    study = load_study(root)
    summary = study.runs[("m", 0)].summary
    assert summary["benchmark"] == "b" and math.isnan(summary["eigen_ratio"])
    assert any("no generations.jsonl" in n for n in study.notes)
