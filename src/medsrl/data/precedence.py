"""Order-of-operations problems with a tempting shortcut: the study task (docs/STUDY.md).

The correct route works multiplications first, one operation per sentence; the *shortcut* works
strictly left to right::

    problem:  Compute 3 + 4 * 2.
    solution: 4 * 2 = 8. 3 + 8 = 11. \\boxed{11}
    shortcut: 3 + 4 = 7. 7 * 2 = 14. \\boxed{14}

A problem where the routes disagree is a **trap**; the warm-start corpus solves a fraction
``shortcut_rate`` of its traps by a wrong route, planting a recurring wrong answer. Other routes
(``wrong_routes``: ``add`` works each ``*`` as ``+``, ``drop`` boxes the first step) split a trap's
errors over several answers: a trap is then one where every named route gives a distinct wrong value.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from medsrl.data.arithmetic import apply_op, check_request, split_of
from medsrl.data.example import MathExample

OPENINGS = ("Compute", "Evaluate")
LEVEL_OPERATORS = {1: 2, 2: 3}
VALUE_MAX = 99
_EXPR = re.compile(r"^(?:Compute|Evaluate) (\d+(?: [-+*] \d+)+)\.$")


@dataclass(frozen=True)
class Route:
    """One way of working an expression: the sentences written and the value reached."""

    lines: tuple[str, ...]
    value: int | None  # None when a step leaves 0..VALUE_MAX

    def solution(self) -> str:
        return " ".join(self.lines) + f" \\boxed{{{self.value}}}"


def shortcut_route(nums: Sequence[int], ops: Sequence[str]) -> Route:
    """Strictly left to right, ignoring that ``*`` binds tighter."""
    value, lines = nums[0], []
    for op, b in zip(ops, nums[1:], strict=True):
        new = apply_op(op, value, b)
        lines.append(f"{value} {op} {b} = {new}.")
        if not 0 <= new <= VALUE_MAX:
            return Route(tuple(lines), None)
        value = new
    return Route(tuple(lines), value)


def _products_first(nums: Sequence[int], ops: Sequence[str], times: str) -> Route:
    """Each ``*`` first (left to right) worked with the operator ``times``, then the rest."""
    nums, ops, lines = list(nums), list(ops), []
    while "*" in ops:
        i = ops.index("*")
        new = apply_op(times, nums[i], nums[i + 1])
        lines.append(f"{nums[i]} {times} {nums[i + 1]} = {new}.")
        if not 0 <= new <= VALUE_MAX:
            return Route(tuple(lines), None)
        nums[i : i + 2] = [new]
        del ops[i]
    rest = shortcut_route(nums, ops)  # no '*' left: left to right is right
    return Route(tuple(lines) + rest.lines, rest.value)


def correct_route(nums: Sequence[int], ops: Sequence[str]) -> Route:
    """Multiplications first (left to right), then ``+`` / ``-`` left to right."""
    return _products_first(nums, ops, "*")


def add_route(nums: Sequence[int], ops: Sequence[str]) -> Route:
    """The right order, but each ``*`` read as ``+``: ``3 - 4 * 2`` worked as ``3 - (4 + 2)``."""
    return _products_first(nums, ops, "+")


def drop_route(nums: Sequence[int], ops: Sequence[str]) -> Route:
    """The correct route's first step (the first product, if any), boxed: the rest forgotten."""
    i = ops.index("*") if "*" in ops else 0
    new = apply_op(ops[i], nums[i], nums[i + 1])
    return Route((f"{nums[i]} {ops[i]} {nums[i + 1]} = {new}.",), new if 0 <= new <= VALUE_MAX else None)


# The wrong routes a corpus can plant (``wrong_routes``), in the correct route's "x op y = z." sentences
WRONG_ROUTES = {"shortcut": shortcut_route, "add": add_route, "drop": drop_route}
DEFAULT_WRONG_ROUTES = ("shortcut",)


def check_routes(wrong_routes: Sequence[str] | str) -> tuple[str, ...]:
    """``wrong_routes`` as a tuple of known, distinct names (a lone string is one name)."""
    names = (wrong_routes,) if isinstance(wrong_routes, str) else tuple(wrong_routes)
    unknown = [n for n in names if n not in WRONG_ROUTES]
    if unknown or not names or len(set(names)) < len(names):
        raise ValueError(f"wrong_routes must be distinct names of {sorted(WRONG_ROUTES)}, got {list(names)}")
    return names


def _trap_kind(right: Route, short: Route, wrong: Sequence[Route]) -> bool | None:
    """False for a plain problem (the shortcut is right), True for a trap (the shortcut and every
    ``wrong`` route valid, distinct and wrong), None for neither (never drawn)."""
    if right.value is None or short.value is None:
        return None
    if short.value == right.value:
        return False
    values = [r.value for r in wrong]
    return True if None not in values and len({*values, right.value}) == len(values) + 1 else None


def parse_expression(problem: str) -> tuple[list[int], list[str]]:
    """``"Compute 3 + 4 * 2."`` -> ``([3, 4, 2], ["+", "*"])``; ValueError for other text."""
    m = _EXPR.match(problem.strip())
    if not m:
        raise ValueError(f"not an order-of-operations problem: {problem!r}")
    parts = m.group(1).split(" ")
    return [int(p) for p in parts[0::2]], parts[1::2]


def is_trap(problem: str, wrong_routes: Sequence[str] = DEFAULT_WRONG_ROUTES) -> bool:
    """Whether the shortcut gives a different answer from the correct route; with other
    ``wrong_routes``, whether they all give valid answers, distinct and all wrong."""
    nums, ops = parse_expression(problem)
    routes = check_routes(wrong_routes)
    if routes == DEFAULT_WRONG_ROUTES:  # as before: an invalid shortcut counts as a trap
        return shortcut_route(nums, ops).value != correct_route(nums, ops).value
    wrong = [WRONG_ROUTES[n](nums, ops) for n in routes]
    return _trap_kind(correct_route(nums, ops), shortcut_route(nums, ops), wrong) is True


def shortcut_answer(problem: str) -> str:
    """The answer the left-to-right shortcut gives (the recurring wrong answer of a trap)."""
    return str(shortcut_route(*parse_expression(problem)).value)


def planted_answers(problem: str, wrong_routes: Sequence[str] = DEFAULT_WRONG_ROUTES) -> dict[str, str]:
    """The answer each of ``wrong_routes`` gives (``"None"`` where a step leaves 0..VALUE_MAX)."""
    nums, ops = parse_expression(problem)
    return {n: str(WRONG_ROUTES[n](nums, ops).value) for n in check_routes(wrong_routes)}


def _draw(n_ops: int, want_trap: bool, rng: random.Random,
          routes: Sequence[str]) -> tuple[str, Route, list[Route]] | None:
    ops = [rng.choice("+-*") for _ in range(n_ops)]
    nums = [rng.randint(2, 9) if i > 0 and ops[i - 1] == "*" else rng.randint(1, 9) for i in range(n_ops + 1)]
    if ops[0] == "*":
        nums[0] = rng.randint(2, 9)  # a times-table fact on both sides of every '*'
    right, wrong = correct_route(nums, ops), [WRONG_ROUTES[n](nums, ops) for n in routes]
    if _trap_kind(right, shortcut_route(nums, ops), wrong) is not want_trap:
        return None
    expr = " ".join(str(nums[0]) if i == 0 else f"{ops[i - 1]} {nums[i]}" for i in range(n_ops + 1))
    return f"{rng.choice(OPENINGS)} {expr}.", right, wrong


def generate_precedence(
    num: int, level: int = 1, seed: int = 0, split: str = "train", trap_fraction: float = 0.5,
    shortcut_rate: float = 0.0, wrong_routes: Sequence[str] = DEFAULT_WRONG_ROUTES,
) -> list[MathExample]:
    """``num`` distinct problems of ``level`` from ``split``, deterministic in ``seed``, solved by the
    correct route, except a trap by one of ``wrong_routes`` (uniform) with probability ``shortcut_rate``."""
    if level not in LEVEL_OPERATORS:
        raise ValueError(f"unknown precedence level {level!r}; known: {sorted(LEVEL_OPERATORS)}")
    check_request(num, split)
    routes = check_routes(wrong_routes)
    for name, p in (("trap_fraction", trap_fraction), ("shortcut_rate", shortcut_rate)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p}")
    rng = random.Random(f"precedence|{seed}|{level}|{split}")
    habit = random.Random(f"precedence-habit|{seed}|{level}|{split}")
    n_traps = round(num * trap_fraction)
    want = [True] * n_traps + [False] * (num - n_traps)
    rng.shuffle(want)
    seen: set[str] = set()
    out: list[MathExample] = []
    for trap in want:
        for _ in range(200_000):  # draws for one problem before the split counts as exhausted
            drawn = _draw(LEVEL_OPERATORS[level], trap, rng, routes)
            if drawn is not None and drawn[0] not in seen and split_of(drawn[0]) == split:
                break
        else:
            raise ValueError(f"could not draw {num} distinct precedence level-{level} problems in split "
                             f"{split!r} (got {len(out)}); ask for fewer")
        problem, right, wrong = drawn
        seen.add(problem)
        u = habit.random() if trap else 1.0  # one draw per trap: planted or not, and which route
        planted = wrong[min(int(u / shortcut_rate * len(wrong)), len(wrong) - 1)] if u < shortcut_rate else right
        out.append(MathExample.make(problem, str(right.value), f"precedence-l{level}", len(out), planted.solution()))
    return out


def generate_precedence_mix(
    num: int, levels: dict[int, float], seed: int = 0, split: str = "train", **options
) -> list[MathExample]:
    """``num`` problems split over ``levels`` (level -> share of ``num``), as the study's
    warm-start corpus mixes them; ``options`` go to :func:`generate_precedence`."""
    total = sum(levels.values())
    if total <= 0:
        raise ValueError(f"levels must give a positive share to some level, got {levels}")
    counts = {int(lv): round(num * share / total) for lv, share in levels.items()}
    out: list[MathExample] = []
    for lv, count in counts.items():
        out += generate_precedence(count, level=lv, seed=seed, split=split, **options)
    return [dataclasses.replace(ex, row=i) for i, ex in enumerate(out)]
