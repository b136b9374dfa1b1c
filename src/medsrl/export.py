"""``medsrl-export CKPT OUT_DIR``: a training checkpoint (a ``.ckpt`` file or a sharded directory) as
a Hugging Face folder, on the CPU; the model is rebuilt from the run's ``<run>/.hydra/config.yaml``.

    medsrl-export logs/train/runs/<run>/checkpoints/step_000020.ckpt exported/step20 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from medsrl.models.checkpoint_files import (
    CheckpointError,
    check_checkpoint,
    load_checkpoint_policy,
    run_cache_dir,
    run_model_config,
)
from medsrl.models.export import save_policy
from medsrl.models.loading import ModelLoadError, resolve_dtype

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("bfloat16", "float32")


def checkpoint_policy(ckpt: str | Path, dtype: str | torch.dtype | None = None):
    """``(policy, tokenizer)`` of a checkpoint; a LoRA run's on the base it started from (a warm-started
    tiny base is found in, or rebuilt into, the run's cache: the checkpoint holds the adapters only)."""
    from medsrl.warmstart import warm_started

    ckpt = check_checkpoint(ckpt)  # a wrong path is named as that before its run's config is looked for
    model = run_model_config(ckpt)
    if model.lora.enabled:
        model = warm_started(model, run_cache_dir(ckpt))
    return load_checkpoint_policy(ckpt, dtype, model=model)


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, dtype: str | None = None, merge: bool = True) -> Path:
    """``ckpt``'s policy and tokenizer into ``out_dir`` the Hugging Face way. Refuses a non-empty
    ``out_dir``: an earlier export's files (an adapter beside merged weights) would be read too."""
    ckpt, out_dir = check_checkpoint(ckpt), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory; export into a new one")
    policy, tokenizer = checkpoint_policy(ckpt)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_policy(policy, tokenizer, out_dir, dtype=resolve_dtype(dtype) if dtype else None, merge_on_export=merge)
    return out_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="medsrl-export",
        description="Write a training checkpoint (a .ckpt file or a sharded checkpoint directory) as a "
                    "Hugging Face folder: safetensors, config and tokenizer. Runs on the CPU.")
    parser.add_argument("ckpt", help="<run>/checkpoints/<name>.ckpt (file or sharded directory); the model is "
                                     "rebuilt from <run>/.hydra/config.yaml")
    parser.add_argument("out_dir", help="the folder to write (new or empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast the saved weights (default: the dtype they were trained in)")
    parser.add_argument("--no-merge", action="store_true",
                        help="LoRA checkpoints: write the adapter alone instead of a merged plain model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    os.environ.setdefault("MEDSRL_ROOT", str(ROOT))  # configs/paths: a run config's cache_dir
    try:
        out = export_checkpoint(args.ckpt, args.out_dir, dtype=args.dtype, merge=not args.no_merge)
    except (CheckpointError, FileNotFoundError, FileExistsError, ModelLoadError) as err:
        sys.exit(f"medsrl-export: {err}")
    print(f"[medsrl] exported {args.ckpt} to {out}")


if __name__ == "__main__":
    main()
