"""End to end on CPU: ``logger=wandb`` (offline: nothing leaves the machine) and ``logger=many``
(TensorBoard + W&B + CSV), with the run's config, its samples table and the step bar; and
``logger=wandb`` without the wandb package fails at start with how to install it."""

from __future__ import annotations

import json
import sys

import pytest

from medsrl.train import parse_run, train
from run_helpers import compose_train, read_metrics, wandb_run_contents, wandb_run_dirs

pytestmark = pytest.mark.slow

SAMPLES_EVERY_STEP = ["callbacks.sample_logger.every_n_steps=1", "callbacks.sample_logger.num_samples=2"]
NO_VALIDATION = ["callbacks.pass_at_k.every_n_steps=0"]


def _tables(run_dir):
    """The rows of every samples table file the run logged, in file order."""
    rows = []
    for path in sorted((run_dir / "files" / "media" / "table").glob("samples_*.table.json")):
        table = json.loads(path.read_text())
        assert table["columns"] == ["step", "key", "problem", "gold", "response", "extracted", "reward", "score"]
        rows += table["data"]
    return rows


def test_logger_wandb_writes_an_offline_run_with_config_and_samples_table(tmp_path, wandb_offline, capsys):
    out = tmp_path / "run"
    cfg = compose_train(out, ["logger=wandb", "tags=[t1,t2]", *SAMPLES_EVERY_STEP, *NO_VALIDATION])
    summary = train(cfg)
    assert summary["steps"] == 2
    (run_dir,) = wandb_run_dirs(out)  # under the run's own dir, not ./wandb or WANDB_DIR
    printed = capsys.readouterr().out
    assert f"wandb sync {run_dir}" in printed  # the banner says how to upload it
    run = wandb_run_contents(run_dir)

    assert run["run"].project == "medsrl"
    assert run["run"].display_name == "debug-meds"  # task_name - algorithm.name
    assert list(run["run"].tags) == ["t1", "t2"]
    config = run["config"]  # the whole resolved config, nested as in the YAML
    assert config["trainer"]["max_steps"] == 2
    assert config["algorithm"]["plugins"]["meds"]["alpha"] == cfg.algorithm.plugins.meds.alpha
    assert config["model"]["tiny"]["hidden_size"] == 32
    assert config["paths"]["output_dir"] == str(out)
    assert config["tags"] == ["t1", "t2"]

    logged = {k for row in run["history"] for k in row}
    assert {"train/reward", "train/acc", "trainer/global_step", "samples._type"} <= logged
    rows = _tables(run_dir)
    assert [r[0] for r in rows] == [0, 0, 1, 1]  # two samples at each of the 2 steps
    jsonl = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r[4] for r in rows] == [r["response"] for r in jsonl]
    assert run["summary"]["steps"] == 2  # the run's summary, put there when the run finished
    assert (run_dir / "files" / "output.log").exists()


def test_logger_many_logs_to_tensorboard_wandb_and_csv_under_the_step_bar(tmp_path, wandb_offline, capsys):
    out = tmp_path / "run"
    train(compose_train(out, ["logger=many", *SAMPLES_EVERY_STEP]))
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    metrics = read_metrics(out)  # csv
    assert sum("train/reward" in m for m in metrics.values()) == 2
    (run_dir,) = wandb_run_dirs(out)
    run = wandb_run_contents(run_dir)
    assert run["config"]["logger"].keys() == {"tensorboard", "csv", "wandb"}
    val = [row["val/accuracy"] for row in run["history"] if "val/accuracy" in row]
    assert len(val) == 2  # before the first step and at the end (validation logs straight to each logger)
    assert run["summary"]["val_accuracy_end"] == pytest.approx(val[-1])
    assert len(_tables(run_dir)) == 4
    # samples.jsonl goes where it went with TensorBoard alone (the first logger's dir)
    assert (out / "tensorboard" / "samples.jsonl").exists()

    printed = capsys.readouterr().out
    assert "step 2/2" in printed and "s/step" in printed and "reward=" in printed
    assert "Epoch" not in printed and "it/s" not in printed


def test_logger_wandb_without_the_package_fails_at_start_saying_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import wandb fails
    cfg = compose_train(tmp_path / "run", ["logger=many"])
    with pytest.raises(ValueError, match=r'logger\.wandb .*pip install -e "\.\[wandb\]"'):
        parse_run(cfg)
    with pytest.raises(ValueError, match="needs the wandb package"):
        train(cfg)  # before any model is built or any file written
    assert not (tmp_path / "run").exists()
    parse_run(compose_train(tmp_path / "run", ["logger=tensorboard"]))  # TensorBoard needs no extra
