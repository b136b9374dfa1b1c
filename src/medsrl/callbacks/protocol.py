"""The rollout-callback protocol: how callbacks take part in one RL step.

Lightning's own hooks cover setup, checkpoint state and logging. What they do not cover is the
middle of a step, between grading and the policy update. Callbacks that subclass
``RolloutCallback`` are called there by the module, in the order they appear in
``trainer.callbacks``; MEDS uses this to capture features and to change scores.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback

if TYPE_CHECKING:
    from medsrl.data.example import Prompt
    from medsrl.reward.grader import GradeResult
    from medsrl.rollout.base import PackedRollouts


@dataclass
class StepRollouts:
    """Everything one step produced, one row per response (a group = one prompt's n responses).

    ``reward`` is the raw graded reward (correctness plus DAPO's overlong penalty) and is what
    ``train/reward`` logs. ``scores`` starts as a copy of it; callbacks may change ``scores`` in
    ``on_rollouts_scored`` and the advantages are computed from ``scores``.
    """

    step: int
    stage: str | None
    prompts: list[Prompt]  # one per group
    group_ids: torch.Tensor  # long [B], index into ``prompts``
    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    grades: list[GradeResult]
    packed: PackedRollouts
    acc: torch.Tensor  # float [B], 1.0 when the answer is right
    reward: torch.Tensor  # float [B], raw reward
    scores: torch.Tensor  # float [B], what advantages are computed from
    old_logp: torch.Tensor | None = None  # [B, R]
    ref_logp: torch.Tensor | None = None  # [B, R]
    engine_logp: torch.Tensor | None = None  # [B, R] the engine's sampling log-probs (rollout.logprobs)
    features: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # logged under train/

    @property
    def keys(self) -> list[str]:
        """The stable prompt key of each response."""
        return [self.prompts[g].key for g in self.group_ids.tolist()]

    def __len__(self) -> int:
        return len(self.response_ids)


class RolloutCallback(Callback):
    """A Lightning callback that also takes part in the RL step. Override what you need."""

    def on_before_logprob_forward(self, trainer, module, rollouts: StepRollouts) -> None:
        """Before the no-grad forward that computes old log-probs (e.g. arm capture hooks)."""

    def logprob_microbatch(
        self, trainer, module, rollouts: StepRollouts, start: int, stop: int
    ) -> AbstractContextManager:
        """A context wrapped around the forward of rows ``start:stop`` of that pass."""
        return nullcontext()

    def on_after_logprob_forward(self, trainer, module, rollouts: StepRollouts) -> None:
        """After that forward (e.g. collect captured features into ``rollouts.features``)."""

    def on_rollouts_scored(self, trainer, module, rollouts: StepRollouts) -> None:
        """Graded and log-probs computed; ``rollouts.scores`` may be changed here."""


def rollout_callbacks(trainer) -> list[RolloutCallback]:
    """The trainer's rollout callbacks, in order."""
    return [cb for cb in trainer.callbacks if isinstance(cb, RolloutCallback)]


def run_log_dir(trainer) -> str:
    """Where a callback writes its files: the first logger's directory, else the root dir.

    Unlike ``trainer.log_dir`` (a broadcast under DDP, which deadlocks when only rank 0 asks),
    this makes no collective call.
    """
    for logger in trainer.loggers:
        if getattr(logger, "log_dir", None):
            return str(logger.log_dir)
    return str(trainer.default_root_dir)
