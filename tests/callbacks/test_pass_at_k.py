"""The held-out validation callback: val/accuracy, val/pass@k and diversity at start, every N
steps and at the end; the run summary reads its first and last accuracy."""

from __future__ import annotations

import json

import pytest

from medsrl.callbacks.pass_at_k import PassAtKValidation
from medsrl.train import train
from run_helpers import MICRO_WARM_START, compose_train, read_metrics

pytestmark = pytest.mark.slow


def test_validation_is_logged_at_start_every_n_steps_and_at_the_end(tmp_path, micro_cache):
    out = tmp_path / "run"
    overrides = [
        *MICRO_WARM_START,
        "callbacks.pass_at_k.n=4",
        "callbacks.pass_at_k.num_problems=6",
        "trainer.max_steps=3",
        "data.val_size=8",
    ]
    summary = train(compose_train(out, overrides, cache_dir=micro_cache))
    metrics = read_metrics(out)
    for step in (0, 2, 3):  # before step 1, every 2 steps, and after the last
        m = metrics[step]
        for name in [
            "val/accuracy",
            "val/pass@1",
            "val/pass@2",
            "val/pass@4",
            "val/maj@n",
            "val/distinct_answers",
            "val/distinct_wrong",
            "val/wrong_clusters",
        ]:
            assert name in m, (step, name)
        assert m["val/accuracy"] == m["val/pass@1"]
        assert m["val/num_samples"] == 6 * 4
        assert m["val/pass@1"] <= m["val/pass@2"] <= m["val/pass@4"]
        assert 1.0 <= m["val/distinct_answers"] <= 4.0  # the warm-started micro model boxes answers
    assert "val/pass@1" not in metrics.get(1, {})
    assert summary["val_accuracy_start"] == metrics[0]["val/accuracy"]
    assert summary["val_accuracy_end"] == metrics[3]["val/accuracy"]
    assert json.loads((out / "summary.json").read_text()) == summary


def test_validation_can_be_turned_off_or_skip_the_start(tmp_path):
    off = tmp_path / "off"
    summary = train(compose_train(off, ["callbacks.pass_at_k.every_n_steps=0"]))
    assert not any(k.startswith("val/") for m in read_metrics(off).values() for k in m)
    assert "val_accuracy_start" not in summary and "val_accuracy_end" not in summary

    late = tmp_path / "late"
    summary = train(compose_train(late, ["callbacks.pass_at_k.at_start=false"]))
    steps = [s for s, m in read_metrics(late).items() if "val/accuracy" in m]
    assert steps == [2]
    assert "val_accuracy_start" not in summary and "val_accuracy_end" in summary


def test_validation_features_follow_the_runs_meds_plugin():
    from types import SimpleNamespace

    from medsrl.methods.meds.features import FeatureSpec
    from medsrl.methods.meds.plugin import Meds

    def resolved(features, plugins):
        cb = PassAtKValidation(features=features)
        cb.setup(None, SimpleNamespace(plugins=plugins), "fit")
        return cb.settings.features

    meds = Meds(layers="half", diff=True, feature_dtype="float32")
    assert resolved("run", [meds]) == FeatureSpec(layers="half", diff=True, dtype="float32")
    assert resolved("run", []) == FeatureSpec()  # no MEDS in the run: the defaults
    assert resolved(None, [meds]) is None
    assert resolved({"layers": 3}, [meds]) == FeatureSpec(layers=3)
