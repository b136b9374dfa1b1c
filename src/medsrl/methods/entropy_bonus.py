"""GRPO+Entropy, the MEDS paper's baseline: a per-token advantage bonus ``min(coef * H, |A| *
cap_ratio)``, with H the old policy's token entropy from the scoring forward (no extra pass)."""

from __future__ import annotations

from typing import Annotated

import torch
from typing_extensions import Doc

from medsrl.algo import masked_mean, per_token
from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import NonNegative
from medsrl.step.rollouts import StepRollouts


def entropy_bonus_advantage(
    advantages: torch.Tensor, entropy: torch.Tensor, coef: float = 0.4, cap_ratio: float = 0.5
) -> torch.Tensor:
    """``A + min(coef * H, |A| * cap_ratio)`` per token [B, T]; ``cap_ratio < 1`` never flips a negative
    advantage; entropy is detached (not a loss term)."""
    adv = per_token(advantages, entropy)
    bonus = torch.minimum(coef * entropy.detach(), adv.abs() * cap_ratio)
    return adv + bonus


class EntropyBonus(Plugin):
    """Turns sequence advantages ``[B]`` into token advantages ``[B, R]`` with the bonus."""

    name = "entropy_bonus"
    token_stats = ("entropy",)

    def __init__(
        self,
        coef: Annotated[NonNegative, Doc(
            "scale of the token entropy in the bonus min(coef * H, |A| * cap_ratio); paper: 0.4")] = 0.4,
        cap_ratio: Annotated[NonNegative, Doc(
            "the bonus is at most |A| * cap_ratio (below 1 it never flips a negative advantage); "
            "paper: |A| / 2")] = 0.5,
    ) -> None:
        self.coef, self.cap_ratio = coef, cap_ratio

    def shape_advantages(self, rollouts: StepRollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        entropy = rollouts.token_stats["entropy"]
        mask = rollouts.packed.response_mask
        adv = advantages.to(entropy.device)
        shaped = entropy_bonus_advantage(adv, entropy, self.coef, self.cap_ratio)
        size = per_token(adv, entropy).abs()
        bonus = torch.minimum(self.coef * entropy, size * self.cap_ratio)
        ctx.log(self, {
            "bonus_mean": float(masked_mean(bonus, mask)),
            "entropy_mean": float(masked_mean(entropy, mask)),
            "capped_frac": float(masked_mean((size * self.cap_ratio < self.coef * entropy).float(), mask)),
        })
        return torch.where(mask.bool(), shaped, torch.zeros_like(shaped))
