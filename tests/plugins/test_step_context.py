"""StepContext: a plug-in's histograms and text reach W&B beside TensorBoard (rank 0 only: the
other ranks' contexts get no loggers)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from medsrl.plugins import Plugin, StepContext
from medsrl.step.metrics import PhaseTimer
from medsrl.utils.wandb_log import finish
from run_helpers import wandb_run_contents


def _ctx(loggers, step=3):
    return StepContext(step, None, PhaseTimer(), 1, loggers=loggers)


def test_histogram_and_text_go_to_wandb(tmp_path, wandb_offline):
    from lightning.pytorch.loggers import WandbLogger

    plugin = Plugin()
    plugin.name = "meds"
    logger = WandbLogger(save_dir=str(tmp_path / "out"), project="medsrl", mode="offline")
    ctx = _ctx([logger])
    ctx.histogram(plugin, "cluster_size", torch.tensor([1, 2, 2, 5]))
    ctx.histogram(plugin, "empty", torch.tensor([]))  # nothing to draw: not logged
    ctx.text(plugin, "largest_error_clusters", "**a** <b> & c")
    run_dir = next((tmp_path / "out" / "wandb").glob(f"offline-run-*-{logger.experiment.id}"))
    finish([logger])

    rows = wandb_run_contents(run_dir)["history"]
    hist = next(r for r in rows if "meds/cluster_size._type" in r)
    assert hist["meds/cluster_size._type"] == "histogram" and hist["trainer/global_step"] == 3
    assert sum(hist["meds/cluster_size.values"]) == 4  # the 4 values, binned
    assert not any("meds/empty._type" in r for r in rows)
    text = next(r for r in rows if "meds/largest_error_clusters._type" in r)
    assert text["meds/largest_error_clusters._type"] == "html-file"
    (html,) = (run_dir / "files").glob("media/html/meds/largest_error_clusters_*.html")
    assert "**a** &lt;b&gt; &amp; c" in html.read_text()  # escaped, shown as written


def test_other_ranks_and_other_loggers_log_nothing():
    class Recorder:
        def __init__(self):
            self.calls = []

        def log_metrics(self, metrics, step=None):
            self.calls.append(metrics)

    plugin = Plugin()
    csv_like = Recorder()
    _ctx([csv_like]).histogram(plugin, "h", torch.ones(3))  # not a W&B (nor TensorBoard) logger
    _ctx([csv_like]).text(plugin, "t", "x")
    assert csv_like.calls == []
    # another rank's context has no loggers (a WandbLogger's experiment would be a dummy there)
    # and no run directory (snapshots are rank 0's)
    trainer = SimpleNamespace(loggers=[object()], is_global_zero=False)
    other = StepContext.for_trainer(trainer, 3, None, PhaseTimer(), 1)
    assert other.loggers == [] and other.run_dir is None
    other.histogram(plugin, "h", torch.ones(3))
    trainer = SimpleNamespace(loggers=[csv_like], is_global_zero=True, default_root_dir="/run")
    assert StepContext.for_trainer(trainer, 3, None, PhaseTimer(), 1).run_dir == "/run"
