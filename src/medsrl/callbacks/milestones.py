"""Weights-only milestones of the policy, all kept (full checkpoints, ~12 bytes a parameter, are not),
saved the Hugging Face way: ``medsrl-eval model_path=<run>/milestones/step_000100`` loads one."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Annotated

from lightning.pytorch.callbacks import Callback
from typing_extensions import Doc

from medsrl.models.loading import resolve_dtype
from medsrl.models.settings import ModelDtype
from medsrl.settings import Count, Text, nullable

log = logging.getLogger(__name__)


class WeightMilestones(Callback):
    """The policy under ``<dirpath>/step_<step>``, via a temporary folder: a crash leaves no half one."""

    def __init__(self, every_n_steps: Annotated[Count, Doc("save the weights every N steps, all kept; 0: off")] = 0,
                 dtype: Annotated[ModelDtype, Doc("their dtype (bfloat16: 2 bytes a parameter)")] = "bfloat16",
                 dirpath: Annotated[nullable(Text), Doc("null: <run>/milestones")] = None) -> None:
        self.every_n_steps = every_n_steps
        self.dtype = resolve_dtype(dtype)
        self.dirpath = dirpath

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # steps done, this one included
        if not self.every_n_steps or step == 0 or step % self.every_n_steps:
            return
        root = Path(self.dirpath or Path(trainer.default_root_dir) / "milestones")
        path = root / f"step_{step:06d}"
        tmp = root / f".step_{step:06d}.tmp"
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        # the engine's memory first (vLLM sleeps until the next step), then every rank exports together
        pl_module.engine.release()
        pl_module.export_policy(tmp, dtype=self.dtype)
        if trainer.is_global_zero:
            shutil.rmtree(path, ignore_errors=True)  # a resumed run re-saves the same step
            tmp.rename(path)
            log.info("step %d: %s weights saved to %s", step, self.dtype, path)
