"""Hyper-parameters with final metrics, for TensorBoard's HParams dashboard.

Every run writes its settings (algorithm with its plug-ins, optimiser, rollout, data, model,
steps, seed, tags) as flat ``key.sub.key`` scalars together with its final validation figures
(``hparams/val_accuracy``, ``hparams/val_pass@8`` ...), so that ``tensorboard --logdir`` over a
multirun's dir compares its runs side by side, one row per run.

Not a Lightning callback: it needs the run's whole config and runs after ``fit`` (from
``train.py``), when the last validation is known. The module's own ``save_hyperparameters`` call
logs no HParams session (``default_hp_metric: false`` in ``configs/logger/tensorboard.yaml``), so
this is the run's only one and nothing shadows the final figures.

W&B (``logger=wandb`` / ``many``) gets the whole resolved config as its run config instead
(:class:`WandbRunConfig`, nested as in the YAML, plus the experiment's name), and the summary goes
into the W&B run's summary when ``train.py`` finishes the run (``medsrl.utils.wandb_log.finish``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

# The parts of the config a comparison of runs is about (dotted paths; absent ones are left out).
HPARAM_KEYS = (
    "seed",
    "tags",
    "algorithm",
    "optim",
    "rollout",
    "data.prompts_per_step",
    "model.name_or_path",
    "model.tiny",
    "trainer.max_steps",
    "trainer.precision",
    "callbacks.pass_at_k.n",
)

Scalar = bool | int | float | str
_ABSENT = object()


def _scalar(value: Any) -> Scalar:
    """A value TensorBoard's HParams can show: lists and None as their JSON text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value)


def _flatten(prefix: str, value: Any, out: dict[str, Scalar]) -> None:
    """``{a: {b: 1}}`` -> ``{"a.b": 1}``; ``_target_`` / ``_partial_`` entries are left out (the
    plug-in's name is the key above them)."""
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            if not str(key).startswith("_"):
                _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = _scalar(value)


def flatten_hparams(cfg: DictConfig, keys: Iterable[str] = HPARAM_KEYS) -> dict[str, Scalar]:
    """The resolved config's ``keys`` as flat, scalar-valued ``key.sub.key`` entries, plus
    ``algorithm.plugin_names`` (the plug-ins in order, also those without settings) and the
    experiment's name when Hydra composed the config."""
    out: dict[str, Scalar] = {}
    for key in keys:
        node = OmegaConf.select(cfg, key, default=_ABSENT)
        if node is _ABSENT:
            continue
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        _flatten(key, value, out)
    plugins = OmegaConf.select(cfg, "algorithm.plugins", default=None) or {}
    out["algorithm.plugin_names"] = ",".join(k for k, v in plugins.items() if v is not None) or "none"
    experiment = _hydra_choice("experiment")
    if experiment is not None:
        out["experiment"] = experiment
    return out


def _hydra_choice(group: str) -> str | None:
    """The option Hydra chose for a config group (None outside ``@hydra.main``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's finite numbers as HParams metrics: ``val/pass@8`` -> ``hparams/val_pass@8``
    (their own tags, so they do not mix with the ``val/`` curves)."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out["hparams/" + key.replace("/", "_")] = float(value)
    return out


def log_final_hparams(loggers: Iterable[Any], cfg: DictConfig, summary: dict[str, Any], step: int) -> None:
    """One HParams session per TensorBoard logger of the run: settings plus final figures.

    Runs after ``fit``, whose end closed the logger's writer: logging opens a new event file in
    the same dir (TensorBoard reads them as one run) and ``finalize`` closes it again.
    """
    from lightning.pytorch.loggers import TensorBoardLogger

    tensorboards = [lg for lg in loggers if isinstance(lg, TensorBoardLogger)]
    if not tensorboards:
        return
    params, metrics = flatten_hparams(cfg), final_metrics(summary)
    for lg in tensorboards:
        lg.log_hyperparams(params, metrics=metrics, step=step)
        lg.finalize("success")


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """The whole config, resolved, as plain nested dicts, plus ``experiment`` (the Hydra choice)
    when Hydra composed it: what a W&B run config shows and filters on."""
    try:
        out = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation only Hydra's own run resolves: keep it as written
        out = OmegaConf.to_container(cfg, resolve=False)
    experiment = _hydra_choice("experiment")
    if experiment is not None:
        out["experiment"] = experiment
    return out


class WandbRunConfig(Callback):
    """Logs the run's resolved config to every ``WandbLogger`` as the W&B run config.

    At the start of training, after Lightning logged the module's own hyper-parameters (the
    algorithm without its plug-ins' settings): the whole config then replaces those keys, so
    ``algorithm.plugins.meds.alpha`` and the rest are in the run config. ``train.py`` adds this
    callback when a W&B logger is configured.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_train_start(self, trainer, pl_module) -> None:
        from medsrl.utils.wandb_log import wandb_loggers

        for lg in wandb_loggers(trainer.loggers):
            lg.log_hyperparams(self.config)  # rank 0 only (Lightning's rank_zero_only)
