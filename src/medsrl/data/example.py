"""The record types that flow from the data files to the training loop."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def prompt_key(problem: str) -> str:
    """Stable key of a problem (16 hex digits of the sha1 of its text), the same in every file and
    run: MEDS memory is keyed on it."""
    return hashlib.sha1(problem.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class MathExample:
    """One math problem with its gold answer, as read from a data file or generated."""

    key: str  # prompt_key(problem)
    problem: str
    answer: str  # gold answer as a string (lists joined with ", ", integral floats without ".0")
    source: str  # dataset name
    row: int  # 0-based row index in the source (for error messages)
    solution: str | None = None  # worked solution, when the source has one

    @classmethod
    def make(cls, problem: str, answer: str, source: str, row: int, solution: str | None = None) -> MathExample:
        return cls(prompt_key(problem), problem, answer, source, row, solution)


@dataclass
class Prompt:
    """What the training loop receives for one problem. Not frozen: Lightning's
    ``apply_to_collection`` (device transfer, precision casts) rebuilds a dataclass field by field
    and refuses a frozen one."""

    key: str
    text: str  # the rendered chat template, ending where the assistant starts writing
    problem: str
    answer: str
    source: str  # the dataset name given in the data config
