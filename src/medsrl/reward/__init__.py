"""Answer extraction and grading against gold answers.
"""

from medsrl.reward.extract import BoxedSpan, extract_last_boxed, find_last_boxed
from medsrl.reward.grader import GradeResult, MathGrader, answers_equivalent

__all__ = [
    "BoxedSpan",
    "GradeResult",
    "MathGrader",
    "answers_equivalent",
    "extract_last_boxed",
    "find_last_boxed",
]
