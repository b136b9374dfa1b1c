"""Checkpoint writes that a crash cannot corrupt (write a temporary file, then rename), and that
never save non-finite weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from medsrl.algo.guard import LIKELY_CAUSES, RunawayError, nonfinite_tensors


class AtomicCheckpointIO(TorchCheckpointIO):
    """Like Lightning's default, but the file at ``path`` is either the old or the new one.

    ``os.replace`` is atomic on POSIX, so a kill mid-save leaves the previous checkpoint (e.g.
    ``last.ckpt``) intact and at most a stray ``*.tmp`` file beside it. A ``state_dict`` with a
    NaN or inf tensor is refused (one max-abs pass over the weights): the last line of defence
    behind the module's runaway guard, which stops such a run before its checkpoint.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        bad = nonfinite_tensors(checkpoint.get("state_dict") or {})
        if bad:
            raise RunawayError(
                f"refusing to write checkpoint {path}: non-finite weights in {len(bad)} tensor(s) "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}). {LIKELY_CAUSES}"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
