"""Training entry point (``medsrl-train``): builds the parts the config names into a Lightning
``Trainer`` and handles the two ways to start from a checkpoint. The step is ``medsrl.module``."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig

from medsrl.callbacks.hparams import WandbRunConfig, log_final_hparams, run_config
from medsrl.callbacks.pass_at_k import _NOT_LOGGED, PassAtKValidation
from medsrl.callbacks.progress import StepProgressBar
from medsrl.data.datamodule import MathDataModule
from medsrl.data.sources import set_data_dir_default
from medsrl.models.lora import target_problems
from medsrl.models.policy import build_policy, meta_model
from medsrl.models.sharding import loads_on_rank0_only
from medsrl.module import RLModule
from medsrl.plugins import Plugin
from medsrl.rollout.factory import describe_prompt_token_limit, prompt_token_limit
from medsrl.run_config import CONFIG_DIR, Built, RunConfig, TrainerSettings
from medsrl.utils.atomic_file import atomic_write
from medsrl.utils.checkpoint_io import AtomicCheckpointIO
from medsrl.utils.rerun import check_identity, finished_summary
from medsrl.utils.wandb_log import describe as describe_wandb
from medsrl.utils.wandb_log import finish as finish_wandb
from medsrl.utils.wandb_log import wandb_loggers
from medsrl.warmstart import warm_started

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))  # configs/paths: root_dir
set_data_dir_default(Path(os.environ["MEDSRL_ROOT"]))  # configs/paths: data_dir on a clone without ../shared

# The step's updates are explicit (manual optimisation); checkpoints hold post-update state by design.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)")
# Each update sets train mode and the frozen KL reference stays in eval mode on purpose.
warnings.filterwarnings("ignore", message="Found .* module\\(s\\) in eval mode at the start of training")


def lora_target_problems(run: RunConfig) -> list[str]:
    """LoRA ``target_modules`` checked on the ``meta`` model before weights load (apply_lora checks later)."""
    if not run.model.lora.enabled:
        return []
    try:
        model = meta_model(run.model)
    except Exception:  # no shape or config.json to build from: apply_lora checks after load
        return []
    return target_problems(model, run.model.lora.target_modules)


def parse_run(cfg: DictConfig) -> RunConfig:
    """The run's typed settings; fails before the model is built, naming every bad value by its key."""
    return RunConfig.parse(cfg, lora_target_problems)


def instantiate_group(group: DictConfig | None, parsed: dict[str, Built] | None = None) -> list[Any]:
    """A config group's ``_target_`` entries, built from their parsed settings if any, else by Hydra."""
    parsed = parsed or {}
    return [b.cls(**dict(b.settings)) if (b := parsed.get(k)) and b.settings is not None else instantiate(c)
            for k, c in (group or {}).items() if c is not None and "_target_" in c]


def build_plugins(plugins: dict[str, Built]) -> list[Plugin]:
    """``RunConfig.algorithm.plugins`` -> plug-ins named by their keys, in order."""
    built = []
    for name, (cls, settings) in plugins.items():
        plugin = cls(**dict(settings))
        plugin.name = name
        built.append(plugin)
    return built


def load_weights_only(module: RLModule, ckpt_path: str) -> int:
    """Policy weights and plug-in state from a checkpoint; optimiser and step stay fresh."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    module.load_state_dict(ckpt["state_dict"])
    states = ckpt.get("callbacks", {})
    for plugin in module.plugins:
        if plugin.state_key in states:
            plugin.load_state_dict(states[plugin.state_key])
    return int(ckpt.get("global_step", 0))


@dataclass
class Run:
    """The parts of one training job, built from the config (benchmarks reach into these)."""

    config: RunConfig
    trainer: L.Trainer
    module: RLModule
    datamodule: L.LightningDataModule
    callbacks: list
    loggers: list


def gpu_environment(trainer: TrainerSettings, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The env a GPU run needs, where the user has not set it (returned), before any CUDA allocation:
    expandable segments, so a fragmented cache does not fail vLLM's KV-cache wake, and
    ``OMP_NUM_THREADS`` (cores per rank), else vLLM sets torch's threads to 1 for the whole process."""
    environ = os.environ if environ is None else environ
    if trainer.accelerator == "cpu":
        return {}
    devices = trainer.devices
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (str, int)):  # "auto", -1: every GPU of the node
        per_node = max(torch.cuda.device_count(), 1)
    else:  # a list of device indices
        per_node = max(len(devices), 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    wanted = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
              "OMP_NUM_THREADS": str(max(1, cores // per_node))}
    added = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(added)
    if "OMP_NUM_THREADS" in added and environ is os.environ:
        torch.set_num_threads(int(added["OMP_NUM_THREADS"]))  # this process's pool is already up
    return added


def build_run(cfg: DictConfig) -> Run:
    """Instantiate data, policy, module, callbacks, loggers and the Lightning trainer."""
    run = parse_run(cfg)
    for key, value in gpu_environment(run.trainer).items():
        log.info("GPU run: %s=%s (not set by the user)", key, value)
    L.seed_everything(run.seed, workers=True)
    torch.set_float32_matmul_precision("high")

    datamodule = MathDataModule(run.data)  # Hydra builds its sources
    # under trainer=fsdp only rank 0 loads the weights; the others build on the meta device
    policy, tokenizer = build_policy(warm_started(run.model, run.paths.cache_dir),
                                     on_meta=loads_on_rank0_only(run.trainer.strategy),
                                     precision=run.trainer.precision)
    datamodule.use_tokenizer(tokenizer)  # data.template.kind=chat renders with its chat template
    datamodule.limit_prompt_tokens(tokenizer, prompt_token_limit(run.rollout, policy),
                                   why=describe_prompt_token_limit(run.rollout, policy))
    module = RLModule(policy, tokenizer, algorithm=run.algorithm, rollout=run.rollout, optim=run.optim,
                      grader=run.grader, plugins=build_plugins(run.algorithm.plugins), seed=run.seed,
                      merge_on_export=run.model.lora.merge_on_export)
    callbacks = with_step_progress_bar(instantiate_group(cfg.get("callbacks"), run.callbacks), run)
    loggers = instantiate_group(cfg.get("logger"))
    if wandb_loggers(loggers):
        callbacks.append(WandbRunConfig(run_config(cfg)))  # the resolved config as the W&B run config
    trainer: L.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()]
    )
    return Run(run, trainer, module, datamodule, callbacks, loggers)


def with_step_progress_bar(callbacks: list, run: RunConfig) -> list:
    """A ``StepProgressBar`` where the callbacks have no bar; none with ``enable_progress_bar=false``."""
    if not run.trainer.enable_progress_bar:
        return [c for c in callbacks if not isinstance(c, ProgressBar)]
    if not any(isinstance(c, ProgressBar) for c in callbacks):
        return [*callbacks, StepProgressBar()]
    return callbacks


def train(cfg: DictConfig, run: Run | None = None) -> dict[str, float]:
    """Run one training job and return its summary (start/end held-out accuracy, steps)."""
    run = run or build_run(cfg)
    trainer, module, loggers = run.trainer, run.module, run.loggers

    ckpt_path = run.config.ckpt_path
    if ckpt_path and run.config.resume_mode == "weights":
        from_step = load_weights_only(module, ckpt_path)
        log.info("weights-only start from %s (its step %d); optimiser and step are fresh", ckpt_path, from_step)
        ckpt_path = None

    out_dir = Path(cfg.paths.output_dir)
    to_wandb = wandb_loggers(loggers)
    for lg in loggers:
        if any(lg is w for w in to_wandb):
            if trainer.is_global_zero:
                print(describe_wandb(lg))  # starts the W&B run
        else:
            print(f"[medsrl] {type(lg).__name__} logs: {lg.log_dir}  (tensorboard --logdir {out_dir})")

    try:
        summary = _fit(cfg, run, ckpt_path, out_dir)
    except BaseException:
        if trainer.is_global_zero:
            finish_wandb(loggers, exit_code=1)
        raise
    if trainer.is_global_zero:
        finish_wandb(loggers, summary)  # the summary into the W&B run's summary; the run closed
    return summary


def _fit(cfg: DictConfig, run: Run, ckpt_path: str | None, out_dir: Path) -> dict[str, float]:
    """``fit``, then the summary, the exported policy, the HParams session and summary.json."""
    trainer = run.trainer
    trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)

    summary: dict[str, float] = {}
    validation = next((cb for cb in run.callbacks if isinstance(cb, PassAtKValidation)), None)
    if validation is not None and validation.history:
        if validation.history[0][0] == 0:
            summary["val_accuracy_start"] = validation.history[0][1]
        summary["val_accuracy_end"] = validation.history[-1][1]
        summary.update(final_validation(validation.last_rows))
    summary["steps"] = trainer.global_step
    if run.config.export_policy:
        run.module.export_policy(out_dir / "policy")  # every rank: FSDP gathers the weights
        if trainer.is_global_zero:
            print(f"[medsrl] final policy saved to {out_dir / 'policy'}")
    if trainer.is_global_zero:
        log_final_hparams(run.loggers, cfg, summary, step=trainer.global_step)  # for HParams
        # last, atomically: its presence means the run is complete (skip_if_done)
        atomic_write(out_dir / "summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
        print(f"[medsrl] summary: {json.dumps(summary)}")
    return summary


def final_validation(rows: list[dict]) -> dict[str, float]:
    """The last validation's finite ``val/<figure>`` s over all problems: what a sweep may optimise."""
    if not rows:
        return {}
    out = {"val/accuracy": float(rows[0]["pass@1"])}
    for name, value in rows[0].items():
        if name in _NOT_LOGGED or isinstance(value, (str, bool)) or value is None:
            continue
        if math.isfinite(float(value)):
            out[f"val/{name}"] = float(value)
    return out


def train_or_skip(cfg: DictConfig) -> dict[str, float]:
    """``train(cfg)``; with ``skip_if_done``: a finished run's summary, or an interrupted one resumed."""
    if not cfg.get("skip_if_done", False):
        return train(cfg)
    out_dir = Path(cfg.paths.output_dir)
    check_identity(cfg, out_dir)
    done = finished_summary(out_dir)
    if done is not None:
        print(f"[medsrl] {out_dir} finished before (summary.json): skipped")
        return done
    last = out_dir / "checkpoints" / "last.ckpt"
    if last.exists():
        was = f" (instead of ckpt_path={cfg.ckpt_path}, resume_mode={cfg.resume_mode})" if cfg.ckpt_path else ""
        print(f"[medsrl] {out_dir} was interrupted: continuing from {last}{was}")
        cfg = cfg.copy()
        cfg.ckpt_path, cfg.resume_mode = str(last), "full"
    return train(cfg)


def optimized_value(cfg: DictConfig, summary: dict[str, float], strict: bool = True) -> float | None:
    """``summary[cfg.optimized_metric]`` for a Hydra sweeper (None: key null). A missing key fails under
    ``strict`` (an optimising sweeper would rank the trial on nothing), else only warns."""
    key = cfg.get("optimized_metric")
    if key is None:
        return None
    if key not in summary:
        msg = (f"optimized_metric={key!r} is not in the run's summary; available: {sorted(summary)} "
               "(val/pass@k needs callbacks.pass_at_k.n >= k and validation on)")
        if strict:
            raise ValueError(msg)
        log.warning(msg)
        return None
    return float(summary[key])


def sweeper_optimises() -> bool:
    """True in a multirun whose sweeper reads ``main``'s value (Optuna, ...), not a plain grid."""
    if not HydraConfig.initialized():
        return False
    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN and not str(hc.sweeper.get("_target_", "")).endswith("BasicSweeper")


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    summary = train_or_skip(cfg)
    return optimized_value(cfg, summary, strict=sweeper_optimises())  # what a Hydra sweeper optimises


if __name__ == "__main__":
    main()
