"""A custom reward (``reward=format_bonus``), the shape ``grader.reward`` takes:
``f(response, gold, **keywords) -> float | GradeResult``, run in the grader's workers with its timeout."""

from __future__ import annotations

from medsrl.reward.extract import extract_last_boxed
from medsrl.reward.grader import answers_equivalent


def format_bonus(response: str, gold: str, *, format_score: float = 0.1) -> float:
    """1 for a right boxed answer, ``format_score`` for a wrong one (the format was kept), 0 for none."""
    answer = extract_last_boxed(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equivalent(gold, answer) else format_score
