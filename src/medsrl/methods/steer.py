"""STEER's per-token loss weight (arXiv 2510.10150): damp the tokens whose update would move the
policy's entropy most. ``Omega = |A / pi_old * pi (1 - pi) (log pi + H)|``, at the start of the update
``|A (1 - pi) (log pi + H)|``, mapped linearly over the batch's tokens to ``[low, high]`` (largest: low).
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor
from typing_extensions import Doc

from medsrl.algo.logprobs import masked_mean, per_token
from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import NonNegative, below
from medsrl.step.rollouts import StepRollouts
from medsrl.utils.distributed import all_gather_objects


def steer_omega(advantages: Tensor, old_logp: Tensor, entropy: Tensor) -> Tensor:
    """``|A (1 - pi) (log pi + H)|`` per token ``[B, T]`` (``A`` may be ``[B]``)."""
    adv = per_token(advantages, old_logp)
    lp = old_logp.detach().float()
    return (adv.detach().float() * (1 - lp.exp()) * (lp + entropy.detach().float())).abs()


def steer_weights(omega: Tensor, mask: Tensor, low: float = 0.8, high: float = 1.2,
                  bounds: tuple[float, float] | None = None) -> Tensor:
    """``high - (high - low) * (omega - min) / (max - min)`` on the masked tokens, 1 elsewhere and
    without spread; ``bounds``: ``(min, max)`` of every rank's tokens."""
    if not low <= high:
        raise ValueError(f"steer weights need low <= high, got {low}, {high}")
    m = mask.bool()
    if bounds is None:
        bounds = (float(omega[m].min()), float(omega[m].max())) if m.any() else (0.0, 0.0)
    lo, hi = bounds
    if hi <= lo:
        return torch.ones_like(omega)
    w = high - (high - low) * (omega - lo) / (hi - lo)
    return torch.where(m, w, torch.ones_like(w))


class Steer(Plugin):
    """Multiplies ``rollouts.loss_weights`` by the STEER weight of each token."""

    name = "steer"
    token_stats = ("entropy",)

    def __init__(
        self,
        low: Annotated[below(NonNegative, "high", or_equal=True), Doc(
            "loss weight of the token with the largest Omega (at most high); paper: 0.8")] = 0.8,
        high: Annotated[NonNegative, Doc(
            "loss weight of the token with the smallest Omega; paper: 1.2")] = 1.2,
    ) -> None:
        self.low, self.high = low, high

    def shape_advantages(self, rollouts: StepRollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        mask = rollouts.packed.response_mask
        omega = steer_omega(advantages.to(mask.device), rollouts.old_logp, rollouts.token_stats["entropy"])
        m = mask.bool()
        local = (float(omega[m].min()), float(omega[m].max())) if m.any() else (float("inf"), float("-inf"))
        parts = all_gather_objects(local)  # the batch is every rank's tokens
        local = (min(p[0] for p in parts), max(p[1] for p in parts))
        w = steer_weights(omega, mask, self.low, self.high, bounds=local)
        rollouts.loss_weights = w if rollouts.loss_weights is None else rollouts.loss_weights * w
        sel = w[m]
        ctx.log(self, {
            "weight_mean": float(masked_mean(w, mask)),
            "weight_min": float(sel.min()) if len(sel) else 1.0,
            "weight_max": float(sel.max()) if len(sel) else 1.0,
            "omega_mean": float(masked_mean(omega, mask)),
        })
        return advantages
