"""The mechanism and dose-response tables, on a hand-made study whose numbers are known."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from studies.collect import Method, RunData, Study
from studies.mechanism import (
    dose_response_rows,
    mechanism,
    render_dose_response,
    render_mechanism,
    stage_mean,
    visits_distribution,
)

STEPS = np.arange(8)  # stage A: steps 0-3, stage B: 4-7


def _curve(a: float, b: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return STEPS, np.where(STEPS < 4, a, b) + 0.1 * seed


def _study(root) -> Study:
    methods = [Method("dapo", "DAPO"), Method("meds", "MEDS"), Method("meds_alpha1.0", "MEDS (alpha 1.0)")]
    runs = {}
    for seed in (0, 1):
        runs[("dapo", seed)] = RunData("dapo", seed, curves={
            "train/shaping/adv_change_frac": _curve(0.0, 0.0, 0), "train/data/visits_mean": _curve(2.0, 6.0, seed)})
        for name, strength in (("meds", 1.0), ("meds_alpha1.0", 3.0)):
            runs[(name, seed)] = RunData(name, seed, curves={
                "train/shaping/adv_change_frac": _curve(0.1 * strength, 0.2 * strength, seed),
                "train/meds/penalised_frac": _curve(0.1, 0.3, seed),
                "train/meds/penalty_on_top_answer": (STEPS, np.full(8, np.nan)),  # never penalised
            })
    return Study(root=root, meta={}, name="hand", methods=methods, seeds=[0, 1], steps_a=4, steps_b=4,
                 baseline="dapo", treatment="meds", runs=runs, missing=[], notes=[])


def test_stage_means_then_seed_means(tmp_path):
    assert stage_mean(_curve(1.0, 3.0, 0), 0, 4) == 1.0 and stage_mean(_curve(1.0, 3.0, 0), 4, None) == 3.0
    assert math.isnan(stage_mean(None, 0, 4))
    table = mechanism(_study(tmp_path))
    # seeds 0 and 1 add 0 and 0.1: the seed mean adds 0.05
    assert table["meds"]["train/meds/penalised_frac"] == pytest.approx({"A": 0.15, "B": 0.35})
    assert table["meds_alpha1.0"]["train/shaping/adv_change_frac"] == pytest.approx({"A": 0.35, "B": 0.65})
    assert table["dapo"]["train/shaping/adv_change_frac"] == {"A": 0.0, "B": 0.0}
    assert "train/meds/penalised_frac" not in table["dapo"]
    assert math.isnan(table["meds"]["train/meds/penalty_on_top_answer"]["A"])
    md = "\n".join(render_mechanism(_study(tmp_path)))
    # the columns logged by some method: visits, penalised, advantage rewritten, penalty on top
    assert "| MEDS (alpha 1.0) | - | 15.0 / 35.0 | 35.0 / 65.0 | - / - |" in md
    assert "| DAPO | 2.05 / 6.05 | - | 0.0 / 0.0 | - |" in md


def test_visits_over_the_run_from_the_last_checkpoints(tmp_path):
    study = _study(tmp_path)
    assert visits_distribution(study, "meds") is None
    for seed, counts in ((0, {"a": 10, "b": 12, "c": 14}), (1, {"a": 8, "b": 8})):
        path = tmp_path / "train" / "meds" / f"seed{seed}" / ("B" if seed == 0 else "A") / "checkpoints"
        path.mkdir(parents=True)
        torch.save({"prompt_visits": counts, "state_dict": {}}, path / "last.ckpt")
    v = visits_distribution(study, "meds")
    # seed 0: min 10, median 12, mean 12, max 14, 3 prompts; seed 1 (stage A only): 8, 8, 8, 8, 2
    assert v == pytest.approx({"min": 9.0, "median": 10.0, "mean": 10.0, "max": 11.0, "prompts": 2.5})
    assert "| MEDS | 2 | 9.0 | 10.0 | 10.0 | 11.0 |" in "\n".join(render_mechanism(study))


def test_dose_response_reads_each_strengths_error_modes(tmp_path):
    study = _study(tmp_path)
    shortcut = {"dapo": (0.60, 0.62), "meds": (0.58, 0.60), "meds_alpha1.0": (0.40, 0.44)}
    for name, shares in shortcut.items():
        for seed, share in enumerate(shares):
            d = tmp_path / "eval" / name / f"seed{seed}"
            d.mkdir(parents=True)
            trap = {"shortcut_share": share, "top_wrong_share": share + 0.1, "distinct_wrong": 2.0 + seed,
                    "accuracy": 0.5}
            (d / "error_modes.json").write_text(json.dumps({"trap": trap, "other": {}}))
    agg = {"methods": [{"name": n, "metrics": {"pass@1": {"values": [0.5, 0.7]}}} for n in shortcut]}
    rows = dose_response_rows(study, agg)
    assert [r["name"] for r in rows] == ["dapo", "meds", "meds_alpha1.0"]
    assert rows[2]["shortcut_share"] == [0.40, 0.44] and rows[0]["pass@1"] == [0.5, 0.7]
    md = "\n".join(render_dose_response(study, agg))
    assert "| MEDS (alpha 1.0) | 50.0 ± 0.0 | 42.0 ± 2.8 | 52.0 ± 2.8 | 2.50 ± 0.71 | 60.0 ± 14.1 |" in md
    assert "training pools" not in md  # not evaluated there
    one = Study(**{**study.__dict__, "methods": study.methods[:2]})
    assert render_dose_response(one, agg) == []  # one strength: no dose-response


def test_the_mechanism_figure_is_drawn_when_a_run_logged_it(tmp_path):
    from studies.report import _figures, write_figures

    study = _study(tmp_path)
    out = write_figures(study, tmp_path / "img")
    assert out["mechanism"].is_file() and out["mechanism"].name == "hand_mechanism.png"
    text = "\n".join(_figures(study, {"mechanism": "img/hand_mechanism.png"}))
    assert "![the mechanism over training](img/hand_mechanism.png)" in text and "step 4." in text
