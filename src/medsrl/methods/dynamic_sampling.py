"""DAPO dynamic sampling: keep only the trainable groups (``Group.trainable``: responses differ in
accuracy, or a plug-in listed before it kept the group); the step samples extra rounds of prompts
until its batch is full or ``max_rounds`` ran (``PluginHost.fill_batch``). Dropped groups go to
``ctx.dropped`` (MEDS can remember them)."""

from __future__ import annotations

import logging
from typing import Annotated

from typing_extensions import Doc

from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import Count
from medsrl.step.rollouts import Group

log = logging.getLogger(__name__)


class DynamicSampling(Plugin):
    """Drops zero-spread groups; the step refills the batch from ``datamodule.extra_prompts``."""

    name = "dynamic_sampling"
    reads_scoring_forward = False

    def __init__(
        self,
        max_rounds: Annotated[Count, Doc(
            "extra generation rounds per step at most, to refill the batch with trainable groups "
            "(reference: 10)")] = 10,
    ) -> None:
        self.max_rounds = max_rounds

    def transform_groups(self, groups: list[Group], ctx: StepContext) -> list[Group]:
        ctx.dropped.extend(g for g in groups if not g.trainable)
        return [g for g in groups if g.trainable]

    def batch_filled(self, extra_rounds: int, kept: float, ctx: StepContext) -> None:
        filled = min(int(kept), ctx.num_prompts)
        if filled < ctx.num_prompts:
            log.info("step %d: dynamic sampling filled %d/%d groups after %d extra rounds",
                     ctx.step, filled, ctx.num_prompts, extra_rounds)
        ctx.log(self, {"extra_rounds": float(extra_rounds), "kept_groups": float(filled),
                       "batch_fill": filled / max(ctx.num_prompts, 1)})

