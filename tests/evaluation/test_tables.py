"""Summary rows and the Markdown / CSV / JSON / PNG files written from them."""

import csv
import json
import math

import numpy as np
import pytest

from medsrl.evaluation.tables import (
    AVERAGE,
    add_average_rows,
    plot_pass_at_k,
    summarize_benchmark,
    write_csv,
    write_json,
    write_markdown,
)

HEADER = (
    "| benchmark | problems | n | pass@1 | pass@2 | pass@4 | mean@n | maj@n "
    "| distinct_answers | distinct_wrong | eigen_ratio | wrong_clusters |"
)


def bench(run, name, shift=0):
    """Two problems, n=4: problem 0 has 1 right of 4, problem 1 has 3 right of 4."""
    answers = [["5", "6", "6", None], ["2", "2", "2", "9"]]
    scores = [[1, 0, 0, 0], [1, 1, 1, 0]]
    rng = np.random.default_rng(shift)
    features = [rng.normal(size=(4, 3)), None]
    return summarize_benchmark(run, name, answers, scores, features)


def test_summarize_benchmark_hand_computed():
    row = bench("grpo", "math500")
    assert row["problems"] == 2 and row["n"] == 4
    # pass@2: c=1 -> 1 - C(3,2)/C(4,2) = .5; c=3 -> 1 (n-c < k); mean .75
    assert row["pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert row["pass@2"] == pytest.approx(0.75)
    assert row["pass@4"] == 1.0
    assert row["mean@n"] == pytest.approx(row["pass@1"])
    assert row["maj@n"] == 0.5  # problem 0: "6" wins, wrong; problem 1: "2" wins, right
    assert row["distinct_answers"] == 2.0  # {5, 6} and {2, 9}
    assert row["distinct_wrong"] == 1.0  # {6} and {9}
    assert 0 < row["eigen_ratio"] <= 1  # problem 1 has no features: mean over problem 0 only
    with pytest.raises(ValueError):
        summarize_benchmark("r", "b", [["1"], ["1", "2"]], [[1], [1, 0]])


def test_average_rows():
    rows = [bench("a", "x"), bench("a", "y", 1), bench("b", "x")]
    out = add_average_rows(rows)
    assert [(r["run"], r["benchmark"]) for r in out] == [
        ("a", "x"), ("a", "y"), ("a", AVERAGE), ("b", "x")
    ]  # fmt: skip
    avg = out[2]
    assert avg["problems"] == 4 and avg["n"] == 4
    assert avg["eigen_ratio"] == pytest.approx(
        (rows[0]["eigen_ratio"] + rows[1]["eigen_ratio"]) / 2
    )
    assert add_average_rows(out) == out  # idempotent


def test_markdown_one_run(tmp_path):
    rows = [bench("grpo", "math500"), bench("grpo", "aime24", 1)]
    path = write_markdown(rows, tmp_path / "table.md")
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER  # no run column: one run only
    assert lines[1].startswith("|---|---:|")
    body = lines[2:]
    assert [line.split(" | ")[0] for line in body] == ["| math500", "| aime24", f"| {AVERAGE}"]
    cells = body[0].strip("| ").split(" | ")
    assert cells[:8] == ["math500", "2", "4", "50.0", "75.0", "100.0", "50.0", "50.0"]
    assert cells[8:10] == ["2.00", "1.00"]


def test_markdown_several_runs(tmp_path):
    rows = [bench("grpo", "math500"), bench("meds", "math500"), bench("meds", "aime24")]
    lines = write_markdown(rows, tmp_path / "t.md").read_text().splitlines()
    assert lines[0].startswith("| run | benchmark |")
    assert len(lines) == 2 + 3 + 1  # header, rule, 3 rows, one average (only meds has two)
    assert lines[-1].startswith(f"| meds | {AVERAGE} |")


def test_markdown_nan_cell(tmp_path):
    row = summarize_benchmark("r", "b", [["1", "2"]], [[1, 0]])  # no features
    line = write_markdown([row], tmp_path / "t.md").read_text().splitlines()[2]
    assert line.endswith("| - | - |")


def test_csv_round_trip(tmp_path):
    rows = [bench("grpo", "math500"), summarize_benchmark("grpo", "tiny", [["1", "2"]], [[1, 0]])]
    path = write_csv(rows, tmp_path / "rows.csv")
    with open(path, newline="") as f:
        back = list(csv.DictReader(f))
    assert len(back) == 2
    assert back[0]["run"] == "grpo" and back[0]["benchmark"] == "math500"
    for key, value in rows[0].items():
        if isinstance(value, float):
            assert float(back[0][key]) == pytest.approx(value)
    assert back[1]["pass@4"] == ""  # n=2 has no pass@4
    assert math.isnan(float(back[1]["eigen_ratio"]))


def test_json_loads(tmp_path):
    rows = [bench("grpo", "math500"), summarize_benchmark("grpo", "tiny", [["1", "2"]], [[1, 0]])]
    back = json.loads(write_json(rows, tmp_path / "rows.json").read_text())
    assert back[0]["pass@2"] == pytest.approx(rows[0]["pass@2"])
    assert back[1]["eigen_ratio"] is None  # nan -> null
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def test_plot_png(tmp_path):
    rows = add_average_rows(
        [bench("grpo", "math500"), bench("meds", "math500"), bench("meds", "b")]
    )
    path = plot_pass_at_k(rows, tmp_path / "sub" / "passk.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000
    with pytest.raises(ValueError):
        plot_pass_at_k([r for r in rows if r["benchmark"] == AVERAGE], tmp_path / "empty.png")
