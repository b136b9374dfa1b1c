"""A run's settings with its final figures, logged after ``fit`` for TensorBoard's HParams dashboard;
W&B gets the whole resolved config instead."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

# The parts of the config a comparison of runs is about (dotted paths; absent ones are left out).
HPARAM_KEYS = (
    "seed", "tags", "algorithm", "optim", "rollout", "data.prompts_per_step", "model.name_or_path",
    "model.tiny", "trainer.max_steps", "trainer.precision", "callbacks.pass_at_k.n",
)

Scalar = bool | int | float | str
_ABSENT = object()


def _flatten(prefix: str, value: Any, out: dict[str, Scalar]) -> None:
    """``{a: {b: 1}}`` -> ``{"a.b": 1}``, lists and None as JSON text; ``_target_`` etc. left out."""
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            if not str(key).startswith("_"):
                _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)


def flatten_hparams(cfg: DictConfig, keys: Iterable[str] = HPARAM_KEYS) -> dict[str, Scalar]:
    """The resolved config's ``keys`` flattened, plus ``algorithm.plugin_names`` and the experiment."""
    out: dict[str, Scalar] = {}
    for key in keys:
        node = OmegaConf.select(cfg, key, default=_ABSENT)
        if node is _ABSENT:
            continue
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        _flatten(key, value, out)
    plugins = OmegaConf.select(cfg, "algorithm.plugins", default=None) or {}
    out["algorithm.plugin_names"] = ",".join(k for k, v in plugins.items() if v is not None) or "none"
    return _with_experiment(out)


def _with_experiment(out: dict) -> dict:
    """``out`` plus the ``experiment`` Hydra chose (none outside ``@hydra.main``)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        experiment = HydraConfig.get().runtime.choices.get("experiment")
        if experiment is not None:
            out["experiment"] = experiment
    return out


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """``val/pass@8`` -> ``hparams/val_pass@8``: own tags, so they do not mix with the curves."""
    return {
        "hparams/" + key.replace("/", "_"): float(value) for key, value in summary.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def log_final_hparams(loggers: Iterable[Any], cfg: DictConfig, summary: dict[str, Any], step: int) -> None:
    """One HParams session per TensorBoard logger (a new event file in the run's dir, closed again)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    tensorboards = [lg for lg in loggers if isinstance(lg, TensorBoardLogger)]
    if not tensorboards:
        return
    params, metrics = flatten_hparams(cfg), final_metrics(summary)
    for lg in tensorboards:
        lg.log_hyperparams(params, metrics=metrics, step=step)
        lg.finalize("success")


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """The whole config as plain nested dicts, plus the Hydra experiment: the W&B run config."""
    try:
        out = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation only Hydra's own run resolves: keep it as written
        out = OmegaConf.to_container(cfg, resolve=False)
    return _with_experiment(out)


class WandbRunConfig(Callback):
    """The resolved config as the W&B run config, at train start: it replaces the module's hparams."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_train_start(self, trainer, pl_module) -> None:
        from medsrl.utils.wandb_log import wandb_loggers

        for lg in wandb_loggers(trainer.loggers):
            lg.log_hyperparams(self.config)  # rank 0 only (Lightning's rank_zero_only)
