"""The MEDS callback set, in the order they must run inside a step."""

from __future__ import annotations

from medsrl.callbacks.error_memory import ErrorMemoryCallback
from medsrl.callbacks.logit_capture import AnswerLogitCapture
from medsrl.callbacks.meds_shaping import MedsShaping
from medsrl.config import MedsConfig


def meds_callbacks(cfg: MedsConfig) -> list:
    """Capture (features from the old-log-prob forward), shaping (reads the memory so far),
    memory (inserts the step and re-fits in the background)."""
    return [
        AnswerLogitCapture(layers=cfg.layers, final_norm=cfg.final_norm, diff=cfg.diff),
        MedsShaping(
            alpha=cfg.alpha,
            beta=cfg.beta,
            target=cfg.target,
            noise_is_cluster=cfg.noise_is_cluster,
            k=cfg.k,
            mode=cfg.mode,
            panels_every_n_steps=cfg.panels_every_n_steps,
        ),
        ErrorMemoryCallback(
            cap_per_key=cfg.cap_per_key,
            refit=cfg.refit,
            refit_workers=cfg.refit_workers,
            min_cluster_size=cfg.min_cluster_size,
            min_samples=cfg.min_samples,
            reset_on_stage_change=cfg.reset_on_stage_change,
            snapshot_every_n_steps=cfg.snapshot_every_n_steps,
        ),
    ]
