"""The study report on a synthetic study: table numbers, significance, figures, the doc block;
protocol v3's blocks (the gate, the routes, the audit)."""

import json
import math
import os
import shutil
import statistics

import numpy as np
import pytest
from studies.collect import Method, RunData, Study, load_study
from studies.plots import align_seeds, moving_average, seed_band
from studies.report import (
    BEGIN,
    END,
    GATE,
    ROUNDS,
    aggregate,
    gate_met,
    gate_table,
    main,
    problem_values,
    render_markdown,
    route_diversity_of,
    update_study_doc,
    visits_to_first_right,
    write_report,
)
from studies.runner import load_protocol

from .test_collect import build_study, problem_samples


def render_results(study_root, rounds: int = ROUNDS) -> str:
    """The study's Markdown results without figures (what ``write_report`` puts in the doc)."""
    study = load_study(study_root)
    return render_markdown(study, aggregate(study, rounds=rounds), {})


PROTOCOL = "# Study\n\nHand-written protocol.\n\n## Results\n\n"
DOC = f"{PROTOCOL}{BEGIN}\nold results\n{END}\n\nAfter the block.\n"


@pytest.fixture(scope="module")
def study_root(tmp_path_factory):
    return build_study(tmp_path_factory.mktemp("study") / "synthetic")


def seed_rows(root, method, column):
    """The column's value in each seed's summary row, computed here from results.json."""
    out = []
    for seed in (0, 1):
        path = root / "eval" / method / f"seed{seed}" / "results.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())
        out.append(statistics.mean(r[column] for r in rows))  # macro average of 2 benchmarks
    return out


def cell(values, percent):
    mean, std = statistics.mean(values), statistics.stdev(values)
    return f"{100 * mean:.1f} ± {100 * std:.1f}" if percent else f"{mean:.2f} ± {std:.2f}"


def table_row(md, label):
    return next(line for line in md.splitlines() if line.startswith(f"| {label} | "))


def test_main_table_numbers(study_root):
    md = render_results(study_root)
    assert "mean ± std over 2 seeds" in md
    for method, label in (("dapo", "DAPO"), ("meds", "MEDS")):
        cells = [c.strip() for c in table_row(md, label).strip("|").split("|")]
        assert cells[:2] == [label, "2"]
        expected = [cell(seed_rows(study_root, method, f"pass@{k}"), True) for k in (1, 8, 32)]
        expected += [
            cell(seed_rows(study_root, method, c), False)
            for c in ("distinct_answers", "distinct_wrong", "eigen_ratio", "wrong_clusters")
        ]
        assert cells[2:] == expected
    # eigen ratio of DAPO, written into results.json as 0.80 and 0.84
    assert "| 0.82 ± 0.03 |" in table_row(md, "DAPO")


def test_header_missing_and_sections(study_root):
    md = render_results(study_root)
    assert "Study `synthetic`: commit `abc1234`, machine: test box (2 CPU cores)." in md
    assert "**Incomplete**" in md and "- train B of meds seed 1: no run directory" in md
    assert "| arith | 6 | DAPO | " in md and "| gsm | 4 | MEDS | " in md  # per benchmark
    assert "#### MEDS vs DAPO" in md and "#### Every method vs DAPO" in md
    assert "![" not in md  # no img_dir: no figures


def test_significance_numbers(study_root):
    study = load_study(study_root)
    agg = aggregate(study, rounds=2000)
    main_cmp = {c["metric"]: c for c in agg["comparisons"] if c["method"] == "meds"}
    assert list(main_cmp) == ["pass@1", "pass@8", "pass@32", "distinct_wrong"]
    c = main_cmp["pass@1"]
    a, b = seed_rows(study_root, "dapo", "pass@1"), seed_rows(study_root, "meds", "pass@1")
    assert c["diff"] == pytest.approx(statistics.mean(b) - statistics.mean(a))
    se = math.sqrt(statistics.variance(a) / 2 + statistics.variance(b) / 2)
    assert c["welch"]["t"] == pytest.approx((statistics.mean(b) - statistics.mean(a)) / se)
    # per problem: MEDS has 4 more right answers of 32 on every problem, so pass@1 is
    # 4/32 higher on each of the 10 problems; all 2^10 sign flips are enumerated
    assert c["paired"]["problems"] == 10 and c["paired"]["exact"]
    assert c["paired"]["diff"] == pytest.approx(4 / 32)
    assert c["paired"]["p"] == pytest.approx(2 / 2**10)
    assert c["significant"] == (c["welch"]["p"] < 0.05)
    # distinct wrong: DAPO's wrong answers take 2 values, MEDS's 4 (3 where only 3 are wrong)
    values = problem_values(study, "meds", "distinct_wrong")
    assert values[("arith", 0)] == 4.0
    assert main_cmp["distinct_wrong"]["paired"]["diff"] > 1.5


def test_problem_values_average_over_seeds(study_root):
    study = load_study(study_root)
    values = problem_values(study, "dapo", "pass@8")
    from medsrl.evaluation.passk import pass_at_k

    by_seed = [sum(problem_samples("dapo", s, "gsm", 1)[1]) for s in (0, 1)]
    expected = statistics.mean(pass_at_k(32, int(c), 8) for c in by_seed)
    assert values[("gsm", 1)] == pytest.approx(expected)
    assert len(values) == 10


def test_write_report_files_and_doc(study_root, tmp_path):
    doc = tmp_path / "docs" / "STUDY.md"
    doc.parent.mkdir()
    doc.write_text(DOC)
    img_dir = tmp_path / "docs" / "img" / "study"
    md = write_report(study_root, doc, img_dir, rounds=2000)
    pngs = sorted(p.name for p in img_dir.iterdir())
    assert pngs == ["synthetic_pass_at_k.png", "synthetic_training_curves.png"]
    assert all((img_dir / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "![pass@k per method](img/study/synthetic_pass_at_k.png)" in md
    text = doc.read_text()
    assert text.startswith(PROTOCOL + BEGIN + "\n") and text.endswith(
        f"\n{END}\n\nAfter the block.\n"
    )
    assert "old results" not in text and md in text
    # the study root gets its own copy, linking the figures from there
    root_md = (study_root / "results.md").read_text()
    rel = os.path.relpath(img_dir / "synthetic_pass_at_k.png", study_root)
    assert rel.startswith("..") and f"]({rel})" in root_md
    agg = json.loads((study_root / "results.json").read_text())
    assert agg["missing"] == ["train B of meds seed 1: no run directory"]
    assert [m["name"] for m in agg["methods"]] == ["dapo", "meds"]
    # running it again changes nothing
    write_report(study_root, doc, img_dir, rounds=2000)
    assert doc.read_text() == text


def test_missing_eval_reported(study_root, tmp_path):
    root = tmp_path / "partial"
    shutil.copytree(study_root, root)
    shutil.rmtree(root / "eval" / "meds" / "seed1")
    md = render_results(root, rounds=500)
    assert "- eval of meds seed 1: no eval directory" in md
    cells = [c.strip() for c in table_row(md, "MEDS").strip("|").split("|")]
    assert cells[1] == "1 of 2"
    assert cells[2] == f"{100 * seed_rows(root, 'meds', 'pass@1')[0]:.1f}"  # one seed: no ± std
    assert "no difference shown" in md  # Welch is undefined with one seed


def test_update_study_doc_only_the_block(tmp_path):
    doc = tmp_path / "STUDY.md"
    doc.write_text(DOC)
    doc.chmod(0o664)
    update_study_doc(doc, "new table\n\nsecond line\n")
    expected = f"{PROTOCOL}{BEGIN}\nnew table\n\nsecond line\n{END}\n\nAfter the block.\n"
    assert doc.read_text() == expected
    assert doc.stat().st_mode & 0o777 == 0o664
    update_study_doc(doc, "new table\n\nsecond line\n")  # idempotent
    assert doc.read_text() == expected
    update_study_doc(doc, "")
    assert doc.read_text() == f"{PROTOCOL}{BEGIN}\n{END}\n\nAfter the block.\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("# Study\n\nno markers\n", "no '<!-- study-results:begin -->'"),
        (f"{BEGIN}\nx\n", "no '<!-- study-results:end -->'"),
        (f"{END}\nx\n{BEGIN}\n", "comes before"),
        (f"{BEGIN}\n{END}\n{BEGIN}\n{END}\n", "2 '<!-- study-results:begin -->'"),
        (f"see {BEGIN} inline\n{END}\n", "no '<!-- study-results:begin -->'"),
    ],
)
def test_update_study_doc_bad_markers(tmp_path, text, message):
    doc = tmp_path / "STUDY.md"
    doc.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        update_study_doc(doc, "results")
    assert doc.read_text() == text


def test_cli_without_doc(study_root, tmp_path, capsys):
    assert main([str(study_root), "--img-dir", str(tmp_path / "img"), "--rounds", "500"]) == 0
    out = capsys.readouterr().out
    assert "### Main table" in out and "results.md" in out
    assert (tmp_path / "img" / "synthetic_training_curves.png").exists()


def test_moving_average():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    # window 3 centred: ends average the 2 points there are
    assert moving_average(x, 3).tolist() == pytest.approx([1.5, 2.0, 3.0, 4.0, 5.0, 5.5])
    assert moving_average(x, 1).tolist() == x.tolist()
    with_nan = moving_average(np.array([1.0, np.nan, 3.0]), 3)
    assert with_nan.tolist() == pytest.approx([1.0, 2.0, 3.0])


def test_align_seeds_and_band():
    steps, values = align_seeds(
        [(np.array([0, 1, 2]), np.array([1.0, 2.0, 3.0])), (np.array([1, 3]), np.array([4.0, 5.0]))]
    )
    assert steps.tolist() == [0, 1, 2, 3]
    assert np.array_equal(
        values, np.array([[1.0, 2.0, 3.0, np.nan], [np.nan, 4.0, np.nan, 5.0]]), equal_nan=True
    )
    mean, lo, hi = seed_band(values)
    assert mean.tolist() == [1.0, 3.0, 3.0, 5.0]
    assert lo.tolist() == [1.0, 2.0, 3.0, 5.0] and hi.tolist() == [1.0, 4.0, 3.0, 5.0]


def test_the_gate_needs_every_figure_past_its_threshold():
    ok = {"g1": [0.3, 0.4], "g2": [0.02], "g3": [0.01], "g4": [0.25]}
    assert gate_met(ok) is True
    assert gate_met({**ok, "g3": [0.0]}) is False
    assert gate_met({**ok, "g4": []}) is None


def test_visits_until_a_hard_trap_is_first_answered_right():
    trap, easy = "Compute 3 + 4 * 2.", "Compute 3 * 4 + 2."

    def rows(key, problem, visits):
        return [{"key": key, "problem": problem, "step": s, "reward": float(r)}
                for s, rewards in enumerate(visits) for r in rewards]

    data = (rows("t1", trap, [[0, 0], [0, 0], [1, 0]])  # hard: right at its 2nd later visit
            + rows("t2", trap, [[0, 0], [0, 0]])  # hard, never right: 1 later visit + 1
            + rows("t3", trap, [[1, 0], [0, 0]])  # not hard
            + rows("e", easy, [[0, 0], [1, 1]]))  # not a trap
    assert visits_to_first_right(data) == (2.0, 2)


def test_route_diversity_counts_routes_per_prompt_within_a_step_and_over_the_run():
    right, short = "4 * 2 = 8. 3 + 8 = 11. \\boxed{11}", "3 + 4 = 7. 7 * 2 = 14. \\boxed{14}"
    rows = [{"key": "a", "problem": "Compute 3 + 4 * 2.", "step": s, "response": t}
            for s, t in ((0, right), (0, right), (1, short), (1, right))]
    # step 0: one route; step 1: two; over the run: two
    assert route_diversity_of(rows) == (1.5, 2.0)


def test_the_gate_table_reads_each_arm_from_its_curves(tmp_path):
    steps = np.arange(3)

    def curves(g1, g2, g3, g4):
        tags = [t for t, _, _ in GATE]
        return {tag: (steps, np.full(3, v, dtype=float)) for tag, v in zip(tags, (g1, g2, g3, g4), strict=True)}

    runs = {("dapo", s): RunData("dapo", s) for s in (0, 1)}
    runs |= {("meds", s): RunData("meds", s, curves=curves(0.5, 0.02 + s / 100, 0.01, 0.4)) for s in (0, 1)}
    runs |= {("weak", s): RunData("weak", s, curves=curves(0.5, 0.02, -0.01, 0.0)) for s in (0, 1)}
    study = Study(tmp_path, {}, "x", [Method("dapo", "DAPO"), Method("meds", "MEDS"), Method("weak", "Weak")],
                  [0, 1], 3, 0, "dapo", "meds", runs, [], [])
    rows = gate_table(study)
    assert rows[2].startswith("| DAPO | - |") and rows[2].endswith("| - |")
    assert "| 2.5 ± 0.7 |" in rows[3] and rows[3].endswith("| yes |")  # G2 in % over the two seeds
    assert rows[4].endswith("| no |")  # G3 < 0: the penalty does not target the repeated mistake


def test_a_protocols_report_has_the_blocks_of_the_parts_that_exist(tmp_path):
    audit = tmp_path / "v3_d1" / "audit"
    audit.mkdir(parents=True)
    (audit / "audit.md").write_text("# MEDS memory audit (D1)\n\nthe table\n")
    (audit / "audit.json").write_text(json.dumps({"variants": [{"feature": "-", "store": "answer"}]}))
    md = write_report(tmp_path, None, tmp_path / "img", load_protocol("v3")["parts"])
    assert md.splitlines()[2:] == ["### D1: the memory audit (no RL)", "", "", "the table", "",
                                   "By the protocol's rule D2's third arm uses the memory **answer** (`mode=answer`)."]
