"""Custom reward functions for the grader's tests: importable by its spawned workers."""

from __future__ import annotations

import time

from medsrl.reward.grader import GradeResult


def length_share(response: str, gold: str, *, scale: float = 1.0) -> float:
    """``scale`` times the share of the gold's characters the response has (hand-checkable)."""
    if gold == "hang":
        time.sleep(3600)  # a reward that never returns: the grader's timeout must cost one zero
    if gold == "boom":
        raise RuntimeError("no reward for you")
    if gold == "text":
        return "high"  # type: ignore[return-value]
    return scale * min(1.0, len(response) / len(gold))


def graded(response: str, gold: str) -> GradeResult:
    return GradeResult(0.5, extracted=response[:3], has_box=False)
