"""Hyper-parameters with final metrics in TensorBoard's HParams dashboard: one session per run,
its settings flat and scalar, its metrics the final validation figures of summary.json."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from medsrl.callbacks.hparams import final_metrics, flatten_hparams
from medsrl.train import train
from run_helpers import compose_train


def test_flatten_keeps_scalars_and_writes_lists_and_null_as_text():
    cfg = OmegaConf.create({
        "seed": 3,
        "tags": ["tiny", "cpu"],
        "algorithm": {"name": "meds", "clip": 0.2, "plugins": {
            "meds": {"_target_": "x.Meds", "alpha": "${algorithm.alpha_default}", "beta": None, "layers": [1, 2]},
            "dynamic_sampling": None}, "alpha_default": 0.1},
        "model": {"name_or_path": None},
    })
    params = flatten_hparams(cfg, keys=("seed", "tags", "algorithm", "model.name_or_path", "trainer.max_steps"))
    assert params["seed"] == 3 and params["tags"] == '["tiny", "cpu"]'
    assert params["algorithm.plugins.meds.alpha"] == 0.1  # resolved
    assert params["algorithm.plugins.meds.beta"] == "null" and params["model.name_or_path"] == "null"
    assert params["algorithm.plugins.meds.layers"] == "[1, 2]"
    assert params["algorithm.plugins.dynamic_sampling"] == "null"
    assert params["algorithm.plugin_names"] == "meds"
    assert not any("_target_" in k for k in params) and "trainer.max_steps" not in params
    assert all(isinstance(v, (bool, int, float, str)) for v in params.values())
    metrics = final_metrics({"val/pass@8": 0.5, "val_accuracy_end": 0.25, "steps": 2, "bad": float("nan")})
    assert metrics == {"hparams/val_pass@8": 0.5, "hparams/val_accuracy_end": 0.25, "hparams/steps": 2.0}


@pytest.mark.slow
def test_a_run_logs_one_hparams_session_with_its_final_figures(tmp_path):
    out = tmp_path / "run"
    summary = train(compose_train(out, ["logger=tensorboard", "trainer.max_steps=1"]))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()

    content = events.PluginTagToContent("hparams")
    assert sorted(content) == ["_hparams_/experiment", "_hparams_/session_end_info",
                               "_hparams_/session_start_info"]  # one session, nothing before it
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["algorithm.name"].string_value == "meds"
    assert hparams["algorithm.plugins.meds.alpha"].number_value == pytest.approx(0.1)
    assert hparams["optim.optimizer.lr"].number_value == pytest.approx(1e-3)  # debug=fast's
    assert hparams["trainer.max_steps"].number_value == 1
    assert hparams["algorithm.plugin_names"].string_value == "overlong,meds"
    assert hparams["data.prompts_per_step"].number_value == 4

    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    names = {m.name.tag for m in experiment.metric_infos}
    assert {"hparams/val_accuracy", "hparams/val_pass@2", "hparams/val_accuracy_end"} <= names
    assert "hp_metric" not in events.Tags()["scalars"]  # default_hp_metric is off
    stored = json.loads((out / "summary.json").read_text())
    for key in ("val/accuracy", "val/pass@2", "val/distinct_answers"):
        (point,) = events.Scalars("hparams/" + key.replace("/", "_"))
        assert point.value == pytest.approx(stored[key]) and point.step == summary["steps"]
