"""Training entry point (``medsrl-train``, ``make train``): Hydra config in, a trained policy out.

Thin on purpose: it builds the parts the config names, wires them into a Lightning ``Trainer``
and handles the two ways to start from a checkpoint. The step itself is ``medsrl.module``.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))
CONFIG_DIR = str(ROOT / "configs")

import hydra  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from medsrl.callbacks.pass_at_k import PassAtKValidation  # noqa: E402
from medsrl.models.policy import build_policy  # noqa: E402
from medsrl.module import RLModule  # noqa: E402
from medsrl.plugins import Plugin  # noqa: E402
from medsrl.utils.checkpoint_io import AtomicCheckpointIO  # noqa: E402

log = logging.getLogger(__name__)

# The step's updates are explicit (manual optimisation); checkpoints hold post-update state by design.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)")
# The policy is put in train mode by each update and the KL reference model stays in eval mode
# on purpose (frozen), so Lightning's check of the modules' modes at the start of fit only warns.
warnings.filterwarnings("ignore", message="Found .* module\\(s\\) in eval mode at the start of training")


def check_config(cfg: DictConfig) -> None:
    """Fail at start, naming the keys, when a required value (``???``) is missing."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"missing required config value(s): {missing}")
    if cfg.resume_mode not in ("full", "weights"):
        raise ValueError(f"resume_mode must be 'full' or 'weights', got {cfg.resume_mode!r}")


def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every entry of a config group that is a dict of named ``_target_`` configs."""
    if not group:
        return []
    return [instantiate(c) for c in group.values() if c is not None and "_target_" in c]


def build_plugins(group: DictConfig | dict | None) -> list[Plugin]:
    """``algorithm.plugins``: ``{name: {_target_: ..., settings}}`` -> plug-ins named by their
    keys, in order; a null entry is left out (``algorithm.plugins.dynamic_sampling=null``)."""
    plugins = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if "_target_" not in node:  # settings (say from an experiment) for a plug-in not chosen
            log.warning("algorithm.plugins.%s has settings but no _target_: not a plug-in of this "
                        "algorithm, ignored", name)
            continue
        plugin = instantiate(node, _convert_="object")
        if not isinstance(plugin, Plugin):
            raise TypeError(f"algorithm.plugins.{name}: {type(plugin).__name__} is not a medsrl Plugin")
        plugin.name = str(name)
        plugins.append(plugin)
    return plugins


def load_weights_only(module: RLModule, ckpt_path: str) -> int:
    """Policy weights and plug-in state from a checkpoint; optimiser and step stay fresh."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    module.load_state_dict(ckpt["state_dict"])
    module.host.upgrade_checkpoint(ckpt)
    states = ckpt.get("callbacks", {})
    for plugin in module.plugins:
        if plugin.state_key in states:
            plugin.load_state_dict(states[plugin.state_key])
    return int(ckpt.get("global_step", 0))


@dataclass
class Run:
    """The parts of one training job, built from the config (benchmarks reach into these)."""

    trainer: L.Trainer
    module: RLModule
    datamodule: L.LightningDataModule
    callbacks: list
    loggers: list


def build_run(cfg: DictConfig) -> Run:
    """Instantiate data, policy, module, callbacks, loggers and the Lightning trainer."""
    check_config(cfg)
    L.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision("high")

    datamodule = instantiate(cfg.data, _convert_="object")
    policy, tokenizer = build_policy(OmegaConf.to_container(cfg.model, resolve=True), cfg.paths.cache_dir)
    algorithm = OmegaConf.to_container(cfg.algorithm, resolve=True)
    module = RLModule(
        policy,
        tokenizer,
        algorithm={k: v for k, v in algorithm.items() if k != "plugins"},
        rollout=OmegaConf.to_container(cfg.rollout, resolve=True),
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        grader=OmegaConf.to_container(cfg.grader, resolve=True),
        plugins=build_plugins(cfg.algorithm.get("plugins")),
        seed=cfg.seed,
    )
    callbacks = instantiate_group(cfg.get("callbacks"))  # the plug-ins join through the module
    loggers = instantiate_group(cfg.get("logger"))
    trainer: L.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()]
    )
    return Run(trainer, module, datamodule, callbacks, loggers)


def train(cfg: DictConfig, run: Run | None = None) -> dict[str, float]:
    """Run one training job and return its summary (start/end held-out accuracy, steps)."""
    run = run or build_run(cfg)
    trainer, module, datamodule = run.trainer, run.module, run.datamodule
    callbacks, loggers = run.callbacks, run.loggers

    ckpt_path = cfg.ckpt_path
    if ckpt_path and cfg.resume_mode == "weights":
        from_step = load_weights_only(module, ckpt_path)
        log.info("weights-only start from %s (its step %d); optimiser and step are fresh", ckpt_path, from_step)
        ckpt_path = None

    out_dir = Path(cfg.paths.output_dir)
    for lg in loggers:
        print(f"[medsrl] {type(lg).__name__} logs: {lg.log_dir}  (tensorboard --logdir {out_dir})")

    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)

    summary: dict[str, float] = {}
    validation = next((cb for cb in callbacks if isinstance(cb, PassAtKValidation)), None)
    if validation is not None and validation.history:
        if validation.history[0][0] == 0:
            summary["val_accuracy_start"] = validation.history[0][1]
        summary["val_accuracy_end"] = validation.history[-1][1]
    summary["steps"] = trainer.global_step
    if cfg.export_policy:
        module.export_policy(out_dir / "policy")  # every rank: FSDP gathers the weights
        if trainer.is_global_zero:
            print(f"[medsrl] final policy saved to {out_dir / 'policy'}")
    if trainer.is_global_zero:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[medsrl] summary: {json.dumps(summary)}")
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    summary = train(cfg)
    return summary.get("val_accuracy_end")  # the value a Hydra sweeper optimises


if __name__ == "__main__":
    main()
