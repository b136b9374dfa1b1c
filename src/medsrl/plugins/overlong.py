"""DAPO's soft overlong penalty as a reward term (``reward/overlong.py`` holds the rule)."""

from __future__ import annotations

import torch

from medsrl.plugins.base import Plugin, StepContext
from medsrl.reward.overlong import overlong_penalty
from medsrl.step.rollouts import StepRollouts


class OverlongPenalty(Plugin):
    """Adds ``overlong_penalty(length)`` to the reward of each response (term ``overlong``)."""

    name = "overlong"
    reads_scoring_forward = False

    def __init__(self, buffer_length: int = 512, penalty_factor: float = 1.0) -> None:
        self.buffer_length = buffer_length
        self.penalty_factor = penalty_factor
        self.max_new_tokens: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.max_new_tokens = pl_module.rollout_cfg.max_new_tokens
        if not 0 < self.buffer_length < self.max_new_tokens:
            raise ValueError(
                f"algorithm.plugins.{self.name}.buffer_length={self.buffer_length} must be between 0 "
                f"and rollout.max_new_tokens={self.max_new_tokens}"
            )

    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        lengths = torch.tensor([len(r) for r in rollouts.response_ids])
        pen = overlong_penalty(lengths, self.max_new_tokens, self.buffer_length, self.penalty_factor)
        rollouts.add_reward(self.name, pen)
