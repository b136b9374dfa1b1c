"""The memory plan of a composed training config, and one phase's holders: what the plan tests
read (``tests/plan/``)."""

from __future__ import annotations

import functools

from medsrl.plan.cli import compose_train_config, plan_for
from medsrl.plan.gpu_bytes import MemoryPlan


@functools.cache
def plan_of(*overrides: str) -> MemoryPlan:
    """``medsrl-plan``'s plan for these overrides (cached: composing is the slow part)."""
    return plan_for(compose_train_config(list(overrides)))


def phase_items(plan: MemoryPlan, phase: str) -> dict[str, int]:
    """Bytes per holder of the one phase named ``phase``."""
    (found,) = [p for p in plan.phases if p.name == phase]
    return {i.name: i.bytes for i in found.items}
