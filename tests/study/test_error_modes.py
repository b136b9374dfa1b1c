"""The study task's error-mode figures, on hand-made evaluation records."""

import math

import numpy as np
import pytest
from studies.error_modes import error_mode_report, render_error_modes


def _rec(problem, gold, answers, features=None):
    return {
        "problem": problem,
        "gold": gold,
        "responses": [
            {"extracted": a, "score": float(a == gold), "feature": None if features is None else features[i]}
            for i, a in enumerate(answers)
        ],
    }


def test_shortcut_share_and_concentration():
    # trap: 3 + 4 * 2 = 11, shortcut 14; other: 2 * 8 + 9 = 25
    records = [
        _rec("Compute 3 + 4 * 2.", "11", ["11", "14", "14", "14", "12", "11"]),
        _rec("Compute 2 * 8 + 9.", "25", ["25", "24", "26", "25"]),
    ]
    r = error_mode_report(records, features=False)
    trap, other = r["trap"], r["other"]
    assert (trap["problems"], trap["samples"], other["samples"]) == (1, 6, 4)
    assert trap["accuracy"] == pytest.approx(2 / 6) and other["accuracy"] == pytest.approx(0.5)
    assert trap["shortcut_share"] == pytest.approx(3 / 4)  # 3 of the 4 wrong answers are 14
    assert trap["top_wrong_share"] == pytest.approx(3 / 4) and other["top_wrong_share"] == pytest.approx(1 / 2)
    assert (trap["distinct_wrong"], other["distinct_wrong"]) == (2, 2)
    assert math.isnan(other["shortcut_share"]) and math.isnan(trap["largest_cluster_share"])


def test_largest_cluster_share_sees_repeated_errors():
    rng = np.random.default_rng(0)
    a, b = np.eye(8)[0], np.eye(8)[1]
    # six wrong answers in two tight groups of features (4 and 2) and one right answer: MEDS's
    # clustering finds the groups, and the larger holds 4 of the 6 errors
    feats = [a + 1e-3 * rng.normal(size=8) for _ in range(4)] + [b + 1e-3 * rng.normal(size=8) for _ in range(2)] + [a]
    rec = _rec("Compute 3 + 4 * 2.", "11", ["14"] * 4 + ["9", "9", "11"], features=[f.tolist() for f in feats])
    share = error_mode_report([rec])["trap"]["largest_cluster_share"]
    assert share == pytest.approx(4 / 6)


def test_no_records_gives_nan_not_an_error():
    r = error_mode_report([])
    assert r["trap"]["problems"] == 0 and math.isnan(r["trap"]["accuracy"])


def test_render_reads_the_precheck_and_each_method(tmp_path):
    import json

    rep = error_mode_report([_rec("Compute 3 + 4 * 2.", "11", ["11", "14"]),
                             _rec("Compute 2 * 8 + 9.", "25", ["25", "25"])], features=False)
    for d in ("precheck", "eval/warm_start/seed0", "eval/meds/seed0", "eval/meds/seed1"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "error_modes.json").write_text(json.dumps(rep))
    md = "\n".join(render_error_modes(tmp_path, [("meds", "MEDS"), ("dapo", "DAPO")], [0, 1]))
    assert "**100.0 % of the wrong answers on traps are the shortcut's answer**" in md
    assert "| warm start | 50.0 | 100.0 | 100.0 |" in md
    assert "| MEDS | 50.0 ± 0.0 | 100.0 ± 0.0 |" in md and "| DAPO |" not in md  # no eval: no row
