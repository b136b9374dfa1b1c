"""DAPO overlong reward shaping: a hard 0 for a response cut off at the limit is noisy (the reasoning
may have been right), so the reward ramps down over the last ``buffer_length`` tokens instead.
"""

from __future__ import annotations

from typing import Annotated

import torch
from typing_extensions import Doc

from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import NonNegative, PositiveInt, below
from medsrl.step.rollouts import StepRollouts


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """The reward term (<= 0): 0 up to ``max - buffer``, then linearly down to ``-penalty_factor`` at ``max``."""
    if not 0 <= buffer_length <= max_response_length:
        raise ValueError(
            f"need 0 <= buffer_length <= max_response_length, got {buffer_length}, {max_response_length}"
        )
    lengths = response_lengths.to(torch.float32)
    expected = max_response_length - buffer_length
    if buffer_length == 0:
        return torch.where(lengths > max_response_length, -penalty_factor, 0.0).to(torch.float32)
    # (expected - len) is <= 0 once past the start of the buffer; written this way round to
    # return +0.0 rather than -0.0 for responses that are short enough.
    ramp = (expected - lengths).clamp(max=0.0) / buffer_length * penalty_factor
    return ramp.clamp(min=-penalty_factor)


class OverlongPenalty(Plugin):
    """Adds ``overlong_penalty(length)`` to the reward of each response (term ``overlong``)."""

    name = "overlong"
    reads_scoring_forward = False

    def __init__(
        self,
        buffer_length: Annotated[below(PositiveInt, "rollout.max_new_tokens"), Doc(
            "the last tokens before rollout.max_new_tokens over which the penalty ramps from 0 down "
            "to -penalty_factor; reference: 512 of a 3072-token budget")] = 512,
        penalty_factor: Annotated[NonNegative, Doc(
            "the penalty at max_new_tokens (the reward term's most negative value)")] = 1.0,
    ) -> None:
        self.buffer_length = buffer_length
        self.penalty_factor = penalty_factor
        self.max_new_tokens: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.max_new_tokens = pl_module.rollout_cfg.max_new_tokens

    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        lengths = torch.tensor([len(r) for r in rollouts.response_ids])
        pen = overlong_penalty(lengths, self.max_new_tokens, self.buffer_length, self.penalty_factor)
        rollouts.add_reward(self.name, pen)
