"""End to end on CPU: ``logger=mlflow`` writes an MLflow run into an SQLite file under the run's
dir (offline), with the step metrics and the module's hyperparameters as params."""

from __future__ import annotations

import sys

import pytest

from medsrl.train import train
from run_helpers import compose_train

pytestmark = pytest.mark.slow


def test_logger_mlflow_writes_an_offline_run_with_metrics_and_params(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra (in dev: make test installs it)")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    summary = train(compose_train(out, ["logger=mlflow", "callbacks.pass_at_k.every_n_steps=0"]))
    assert summary["steps"] == 2
    store = out / "mlflow.db"
    assert store.is_file()  # under the run's own dir, not ./mlruns
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "medsrl"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "debug-meds"  # task_name - algorithm.name
    assert run.info.status == "FINISHED"
    rewards = client.get_metric_history(run.info.run_id, "train/reward")
    assert sorted(m.step for m in rewards) == [0, 1]
    params = run.data.params  # the module's hyperparameters, flattened
    assert params["algorithm/name"] == "meds" and params["rollout/n"] == str(compose_train(out).rollout.n)


def test_logger_mlflow_without_the_package_fails_at_start_saying_how_to_install(tmp_path, monkeypatch):
    """make install has no extras: logger=mlflow then names the extra before any model is built."""
    from medsrl.train import parse_run

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ValueError, match=r"logger\.mlflow .*needs the mlflow package.*make install EXTRAS=mlflow"):
        parse_run(compose_train(tmp_path / "run", ["logger=mlflow"]))
