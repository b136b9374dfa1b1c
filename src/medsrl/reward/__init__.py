"""Answer extraction, grading against gold answers, and DAPO overlong shaping.

``overlong_penalty`` is imported lazily so that grader worker processes, which import this
package, do not pay for importing torch.
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
    "overlong_penalty",
]


def __getattr__(name: str):
    if name == "overlong_penalty":
        from medsrl.reward.overlong import overlong_penalty

        return overlong_penalty
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
