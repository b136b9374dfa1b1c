"""Synthetic arithmetic word problems with worked solutions, for the tiny CPU preset.

A problem chains a few operations on a running number::

    problem:  Start at 5, multiply by 2, take away 4, multiply by 2.
    solution: 5 * 2 = 10. 10 - 4 = 6. 6 * 2 = 12. \\boxed{12}

Every intermediate result is written out, so a ~1M-parameter char-level model learns one small
operation per step in minutes of warm start on a CPU (docs/WARMSTART.md). Splits are disjoint by
construction: sha1(problem) % 10 is 0 for ``test``, 1 for ``val``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cache, lru_cache

from medsrl.data.example import MathExample

# Bump when the generated text changes, so cached warm starts are rebuilt.
GENERATOR_VERSION = 1

SPLITS = ("train", "val", "test")

START_PHRASES = ("Start at {n}", "Start with {n}")
OP_PHRASES = {
    "+": ("add {d}", "plus {d}"),
    "-": ("take away {d}", "subtract {d}"),
    "*": ("multiply by {d}", "times {d}"),
}


@dataclass(frozen=True)
class Level:
    """How problems of one difficulty level are drawn (multiplication: a times-table fact)."""

    min_ops: int
    max_ops: int
    start_min: int = 1
    start_max: int = 9
    operand_max: int = 9  # add / subtract operands are 1..operand_max
    mul_max: int = 9  # multiply operands are 2..mul_max
    mul_value_max: int = 9  # multiplication offered only while the running value <= this
    value_max: int = 99  # every running value stays in 0..value_max


LEVELS: dict[int, Level] = {
    1: Level(min_ops=2, max_ops=2),
    2: Level(min_ops=2, max_ops=3),
    3: Level(min_ops=3, max_ops=4, start_max=20),
}

# Spaces with at most this many distinct problems are enumerated once to know the split's size.
_ENUMERATE_LIMIT = 400_000


def split_of(problem: str) -> str:
    bucket = int(hashlib.sha1(problem.encode("utf-8")).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def apply_op(op: str, a: int, d: int) -> int:
    return a + d if op == "+" else a - d if op == "-" else a * d


def _choices(spec: Level, value: int) -> list[tuple[str, list[int]]]:
    """Operations (with their allowed operands) available at ``value``."""
    mul = value <= spec.mul_value_max  # a times-table fact only
    ops = [
        ("+", [d for d in range(1, spec.operand_max + 1) if value + d <= spec.value_max]),
        ("-", [d for d in range(1, spec.operand_max + 1) if value - d >= 0]),
        ("*", [d for d in range(2, spec.mul_max + 1) if mul and value * d <= spec.value_max]),
    ]
    return [(op, operands) for op, operands in ops if operands]


def _render(start: int, start_phrase: int, steps: list[tuple[str, int, int]]) -> tuple[str, str, int]:
    """(problem, solution, answer) for a start value and steps (op, operand, phrase index)."""
    parts = [START_PHRASES[start_phrase].format(n=start)]
    lines = []
    value = start
    for op, d, phrase in steps:
        parts.append(OP_PHRASES[op][phrase].format(d=d))
        new = apply_op(op, value, d)
        lines.append(f"{value} {op} {d} = {new}.")
        value = new
    problem = ", ".join(parts) + "."
    solution = " ".join(lines) + f" \\boxed{{{value}}}"
    return problem, solution, value


def _draw(spec: Level, rng: random.Random) -> tuple[str, str, int]:
    start = rng.randint(spec.start_min, spec.start_max)
    start_phrase = rng.randrange(len(START_PHRASES))
    n_ops = rng.randint(spec.min_ops, spec.max_ops)
    value = start
    steps = []
    for _ in range(n_ops):
        op, operands = rng.choice(_choices(spec, value))
        d = rng.choice(operands)
        steps.append((op, d, rng.randrange(len(OP_PHRASES[op]))))
        value = apply_op(op, value, d)
    return _render(start, start_phrase, steps)


@cache
def space_size(level: int) -> int:
    """Number of distinct problem texts of a level (all splits together)."""
    spec = _level(level)

    @cache
    def paths(value: int, remaining: int) -> int:
        if remaining == 0:
            return 1
        return sum(len(OP_PHRASES[op]) * paths(apply_op(op, value, d), remaining - 1)
                   for op, operands in _choices(spec, value) for d in operands)

    return sum(len(START_PHRASES) * paths(start, n) for start in range(spec.start_min, spec.start_max + 1)
               for n in range(spec.min_ops, spec.max_ops + 1))


@lru_cache(maxsize=8)
def _enumerate_split(level: int, split: str) -> tuple[tuple[str, str, int], ...]:
    """Every problem of a (small) level that falls into ``split``, in a fixed order."""
    spec = _level(level)
    out = []

    def walk(start, start_phrase, value, steps, remaining):
        if remaining == 0:
            item = _render(start, start_phrase, steps)
            if split_of(item[0]) == split:
                out.append(item)
            return
        for op, operands in _choices(spec, value):
            for d in operands:
                new = apply_op(op, value, d)
                for phrase in range(len(OP_PHRASES[op])):
                    walk(start, start_phrase, new, [*steps, (op, d, phrase)], remaining - 1)

    for start in range(spec.start_min, spec.start_max + 1):
        for start_phrase in range(len(START_PHRASES)):
            for n in range(spec.min_ops, spec.max_ops + 1):
                walk(start, start_phrase, start, [], n)
    return tuple(out)


def check_request(num: int, split: str) -> None:
    """Refuse an unknown split or a negative count (both generators)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")


def _level(level: int) -> Level:
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; known: {sorted(LEVELS)}")
    return LEVELS[level]


def generate_arithmetic(num: int, level: int = 1, seed: int = 0, split: str = "train") -> list[MathExample]:
    """``num`` distinct problems of ``level`` from ``split``, deterministic in ``seed``, with
    worked solutions; ``ValueError`` when the split holds fewer than ``num`` problems."""
    spec = _level(level)
    check_request(num, split)
    total = space_size(level)
    enumerable = total <= _ENUMERATE_LIMIT
    if num > total:
        raise ValueError(f"arithmetic level {level} has only {total} distinct problems in all; "
                         f"asked for {num} ({split})")
    if enumerable:
        capacity = len(_enumerate_split(level, split))
        if num > capacity:
            raise ValueError(f"arithmetic level {level} split {split!r} holds only {capacity} distinct problems; "
                             f"asked for {num}")

    rng = random.Random(f"arithmetic|{seed}|{level}|{split}")
    seen: set[str] = set()
    items: list[tuple[str, str, int]] = []
    # Draws in a row that add nothing new before giving up (sooner where the enumeration fills up)
    stall_limit = 2_000 + 2 * num if enumerable else 20_000 + 20 * num
    stalled = 0
    while len(items) < num and stalled < stall_limit:
        item = _draw(spec, rng)
        if item[0] in seen or split_of(item[0]) != split:
            stalled += 1
        else:
            stalled = 0
            seen.add(item[0])
            items.append(item)

    if len(items) < num:
        if not enumerable:
            raise ValueError(f"could not draw {num} distinct problems of arithmetic level {level} in split "
                             f"{split!r} (got {len(items)}); the space is too small for this request")
        # Near the split's capacity rejection sampling stalls: fill up from the enumeration.
        rest = [item for item in _enumerate_split(level, split) if item[0] not in seen]
        rng.shuffle(rest)
        items.extend(rest[: num - len(items)])

    return [MathExample.make(problem, str(answer), f"arithmetic-l{level}", i, solution)
            for i, (problem, solution, answer) in enumerate(items)]
