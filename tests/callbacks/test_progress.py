"""The step progress bar: "step 2/2" with seconds per step and the prog_bar metrics, no epochs."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from omegaconf import OmegaConf

from medsrl.callbacks.progress import StepProgressBar, set_progress_status
from medsrl.train import with_step_progress_bar


class ToyStep(L.LightningModule):
    """One RL-like step per batch: logs train/reward and train/acc to the bar, train/time/step not."""

    def __init__(self, log_step_time: float | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.log_step_time = log_step_time

    def training_step(self, batch, batch_idx):
        self.log("train/reward", 0.25 * (self.global_step + 1), prog_bar=True, batch_size=1)
        self.log("train/acc", 0.5, prog_bar=True, batch_size=1)
        if self.log_step_time is not None:
            self.log("train/time/step", self.log_step_time, batch_size=1)
        return (self.w - batch.float().mean()).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(8), batch_size=1)


class Validation(Callback):
    """Stands in for PassAtKValidation: says "validating" before the first step."""

    def __init__(self) -> None:
        self.seen = []

    def on_train_start(self, trainer, pl_module):
        set_progress_status(trainer, "validating")
        self.seen.append(trainer.progress_bar_callback.train_progress_bar.n)
        set_progress_status(trainer, "")


def _fit(callbacks, max_steps=2, max_epochs=-1, module=None):
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, max_epochs=max_epochs, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module or ToyStep())
    return trainer


def _lines(text: str) -> list[str]:
    """What a terminal shows: tqdm redraws with carriage returns."""
    return [part.strip() for part in re.split(r"[\r\n]", text) if part.strip()]


def test_bar_counts_steps_with_seconds_per_step_and_metrics_and_no_epochs(capsys):
    _fit([StepProgressBar()])
    lines = [line for line in _lines(capsys.readouterr().out) if line.startswith("step ")]
    assert lines[0].startswith("step 0/2 ")
    last = lines[-1]
    assert re.match(r"step 2/2 \|█+\| \[\d\d:\d\d<00:00, [\d.]+s/step, reward=0\.500, acc=0\.500\]$", last), last
    assert not any("Epoch" in line or "it/s" in line or "v_num" in line for line in lines)


def test_seconds_per_step_are_the_logged_step_time_averaged_over_the_window(capsys):
    bar = StepProgressBar(window=2)
    _fit([bar], max_steps=3, module=ToyStep(log_step_time=4.0))
    assert bar.seconds_per_step() == pytest.approx(4.0)
    assert "step 3/3" in capsys.readouterr().out and "4.0s/step" in bar.postfix(bar.trainer)


def test_without_max_steps_the_bar_counts_without_a_total(capsys):
    _fit([StepProgressBar()], max_steps=-1, max_epochs=1)  # the 8 batches of one epoch
    lines = _lines(capsys.readouterr().out)
    assert any(re.match(r"step 8 \[\d\d:\d\d, [\d.]+s/step, reward=2\.000, acc=0\.500\]$", line)
               for line in lines), lines
    assert not any("Epoch" in line for line in lines)


def test_validation_before_the_first_step_shows_on_the_bar(capsys):
    validation = Validation()
    _fit([validation, StepProgressBar()])  # the bar last, as in configs/callbacks/default.yaml
    assert validation.seen == [0]
    lines = _lines(capsys.readouterr().out)
    assert any(line.startswith("step 0/2 ") and line.endswith("validating]") for line in lines), lines
    assert lines[-1].startswith("step 2/2") and "validating" not in lines[-1]


def test_refresh_rate_zero_draws_nothing(capsys):
    _fit([StepProgressBar(refresh_rate=0)])
    assert "step " not in capsys.readouterr().out


def test_config_always_gets_the_step_bar_never_lightnings_epoch_bar():
    cfg = OmegaConf.create({"trainer": {"enable_progress_bar": True}})
    other = Callback()
    added = with_step_progress_bar([other], cfg)  # callbacks=none, or a group without a bar
    assert added[0] is other and isinstance(added[-1], StepProgressBar)
    own = TQDMProgressBar()
    assert with_step_progress_bar([own], cfg) == [own]  # a configured bar is kept
    off = OmegaConf.create({"trainer": {"enable_progress_bar": False}})
    assert with_step_progress_bar([other, StepProgressBar()], off) == [other]


def test_the_bar_is_not_part_of_a_runs_identity(tmp_path):
    """skip_if_done compares run identities: a stored run (before the bar existed, or with
    another refresh rate) is still the same run."""
    from medsrl.utils.rerun import run_identity
    from run_helpers import compose_train

    plain = run_identity(compose_train(tmp_path / "a"))
    assert "progress_bar" not in plain["callbacks"]
    quiet = run_identity(compose_train(tmp_path / "b", ["callbacks.progress_bar.refresh_rate=5",
                                                        "trainer.enable_progress_bar=false"]))
    assert quiet == plain
