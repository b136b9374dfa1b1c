"""Checkpoint writes that a crash cannot corrupt, and that never save non-finite weights."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from medsrl.utils.atomic_file import atomic_write
from medsrl.utils.guard import LIKELY_CAUSES, RunawayError, nonfinite_tensors


class AtomicCheckpointIO(TorchCheckpointIO):
    """Like Lightning's default, but a kill mid-save leaves the previous checkpoint intact, and a
    ``state_dict`` with a NaN or inf tensor is refused (the last defence behind the runaway guard).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        bad = nonfinite_tensors(checkpoint.get("state_dict") or {})
        if bad:
            raise RunawayError(
                f"refusing to write checkpoint {path}: non-finite weights in {len(bad)} tensor(s) "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}). {LIKELY_CAUSES}"
            )
        atomic_write(path, lambda f: torch.save(checkpoint, f), mode=0o644)
