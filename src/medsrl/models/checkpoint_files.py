"""A training run's checkpoints as files, for evaluation and export: which path is a checkpoint,
the run it belongs to, and the policy it holds, rebuilt on the CPU in one process.

A single file (``torch.save``) keeps the module's weights under ``"state_dict"``; a sharded one is
a ``torch.distributed.checkpoint`` (DCP) directory. Either way the policy's weights are named
``policy.<Hugging Face name>`` (with LoRA the adapters only). The model is rebuilt from the run's
``<run>/.hydra/config.yaml`` and only the policy's keys are read, never the AdamW moments.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from medsrl.models import lora
from medsrl.models.settings import ModelConfig

log = logging.getLogger(__name__)

POLICY_PREFIX = "policy."
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded checkpoint
# The DCP key holding the module's weights: ModelParallelStrategy (FSDP2), then FSDPStrategy (FSDP1)
MODULE_KEYS = ("state_dict", "model")
# Wrapper names FSDP1 or activation checkpointing may leave in a parameter's name
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message names the path and what to do."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA).is_file()


def is_checkpoint_path(path: str | Path) -> bool:
    """A ``.ckpt`` (existing or not, so a wrong one fails as a checkpoint) or a DCP directory."""
    return Path(path).suffix == ".ckpt" or is_sharded_checkpoint(path)


def check_checkpoint(path: str | Path) -> Path:
    """``path`` when it is a single-file or sharded checkpoint, else an error that says which it is not."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path}: a directory but not a sharded checkpoint (no {DCP_METADATA}, the index "
                              "torch.distributed.checkpoint writes); a sharded checkpoint is the directory "
                              "<run>/checkpoints/step_<n>.ckpt holding *.distcp files, a .metadata and meta.pt")
    return path


def run_dir(ckpt: str | Path) -> Path:
    """The run a checkpoint belongs to: ``<run>`` of ``<run>/checkpoints/<name>.ckpt``."""
    return Path(ckpt).parent.parent


def run_config_path(ckpt: str | Path) -> Path:
    path = run_dir(ckpt) / ".hydra" / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt}: cannot rebuild the model, {path} (the run's Hydra config) is missing; the "
                                "checkpoint must stay at <run>/checkpoints/ beside <run>/.hydra/, or evaluate the "
                                "exported policy directory instead")
    return path


def run_model_config(ckpt: str | Path) -> ModelConfig:
    from medsrl.settings import parse

    path = run_config_path(ckpt)
    model = OmegaConf.to_container(OmegaConf.load(path).model, resolve=False)
    return parse(ModelConfig, model, f"{path}: model")


def run_precision(ckpt: str | Path) -> str | int:
    """With LoRA ``trainer.precision`` sets the frozen base's dtype, which the adapters were trained on."""
    cfg = OmegaConf.load(run_config_path(ckpt))
    return OmegaConf.select(cfg, "trainer.precision", default="32-true", throw_on_resolution_failure=False) or "32-true"


def run_cache_dir(ckpt: str | Path) -> Path:
    """The run's ``paths.cache_dir`` (where its warm start is), else the repository's default."""
    cfg = OmegaConf.load(run_config_path(ckpt))
    cache = OmegaConf.select(cfg, "paths.cache_dir", default=None, throw_on_resolution_failure=False)
    return Path(cache) if cache else Path(os.environ.get("MEDSRL_ROOT", ".")) / "data" / "cache"


def _module_name(stored: str) -> str | None:
    """A stored module key as the policy names it, or None for another module's (the KL reference)."""
    if not stored.startswith(POLICY_PREFIX):
        return None
    name = stored.removeprefix(POLICY_PREFIX)
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _sharded_policy_entries(ckpt: Path) -> tuple[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """The DCP module key and ``{policy name: (stored key, shape)}`` from the index alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(ckpt).read_metadata()
    paths = metadata.planner_data or {}
    by_top: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for flat, item in metadata.state_dict_metadata.items():
        path = paths.get(flat)
        if not isinstance(item, TensorStorageMetadata) or not path or len(path) != 2:
            continue
        top, stored = path
        name = _module_name(str(stored))
        if top in MODULE_KEYS and name is not None:
            by_top.setdefault(str(top), {})[name] = (str(stored), tuple(item.size))
    for top in MODULE_KEYS:
        if top in by_top:
            return top, by_top[top]
    tops = sorted({str(p[0]) for p in paths.values() if p})
    raise CheckpointError(f"{ckpt}: a sharded checkpoint without the policy's weights (no policy.* tensors under "
                          f"{' or '.join(MODULE_KEYS)}; its top-level keys: {tops})")


def _single_file_policy(ckpt: Path) -> dict[str, torch.Tensor]:
    """Memory-mapped: the optimizer states beside the weights are never read into memory."""
    try:
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # a file of the legacy (non-zip) format cannot be mapped
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{ckpt}: not a Lightning checkpoint (no 'state_dict')")
    names = {key: _module_name(key) for key in checkpoint["state_dict"]}
    return {name: checkpoint["state_dict"][key] for key, name in names.items() if name is not None}


def stored_policy_shapes(ckpt: str | Path) -> dict[str, tuple[int, ...]]:
    ckpt = check_checkpoint(ckpt)
    if is_sharded_checkpoint(ckpt):
        return {name: shape for name, (_, shape) in _sharded_policy_entries(ckpt)[1].items()}
    return {name: tuple(t.shape) for name, t in _single_file_policy(ckpt).items()}


def _check_fits(ckpt: Path, targets: dict[str, torch.Tensor], stored: dict[str, tuple[int, ...]],
                is_lora: bool) -> None:
    missing = sorted(set(targets) - set(stored))
    unexpected = sorted(set(stored) - set(targets))
    where = f"{ckpt} (the model rebuilt from {run_dir(ckpt) / '.hydra' / 'config.yaml'})"
    if missing or unexpected:
        raise CheckpointError(f"{where}: {lora.mismatch_message(missing, unexpected, is_lora)}")
    wrong = [f"{k}: stored {list(stored[k])}, model {list(targets[k].shape)}"
             for k in targets if tuple(targets[k].shape) != stored[k]]
    if wrong:
        raise CheckpointError(f"{where}: checkpoint does not match the policy's shapes: {'; '.join(wrong[:5])}")


def load_policy_weights(policy: nn.Module, ckpt: str | Path) -> None:
    """Copy a checkpoint's policy weights into ``policy``'s own tensors (LoRA: the adapters)."""
    ckpt = check_checkpoint(ckpt)
    is_lora = lora.is_lora(policy)
    targets = lora.checkpoint_state(policy.state_dict(), is_lora)  # detached views of its weights
    if is_sharded_checkpoint(ckpt):
        from torch.distributed.checkpoint import FileSystemReader, load

        top, entries = _sharded_policy_entries(ckpt)
        _check_fits(ckpt, targets, {name: shape for name, (_, shape) in entries.items()}, is_lora)
        state = {top: {entries[name][0]: t for name, t in targets.items()}}  # only these keys are read
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
            load(state, storage_reader=FileSystemReader(ckpt), no_dist=True)
        return
    stored = _single_file_policy(ckpt)
    _check_fits(ckpt, targets, {k: tuple(v.shape) for k, v in stored.items()}, is_lora)
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(stored[name])


def load_checkpoint_policy(ckpt: str | Path, dtype: str | torch.dtype | None = None,
                           model: ModelConfig | None = None):
    """``(policy, tokenizer)`` of a checkpoint, on the CPU: ``model`` (default: the run's; with LoRA
    the base the run started from) built as the run built it, cast to ``dtype`` when given."""
    from medsrl.models.loading import resolve_dtype
    from medsrl.models.policy import build_policy

    ckpt = check_checkpoint(ckpt)
    policy, tokenizer = build_policy(model or run_model_config(ckpt), precision=run_precision(ckpt))
    load_policy_weights(policy, ckpt)
    if dtype is not None and resolve_dtype(dtype) != "auto":
        policy = policy.to(resolve_dtype(dtype))
    log.info("%s: %s checkpoint of %s loaded", ckpt, "sharded" if is_sharded_checkpoint(ckpt) else "single-file",
             type(lora.unwrap_peft(policy)).__name__)
    return policy, tokenizer
