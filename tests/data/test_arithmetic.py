"""Tests for the synthetic arithmetic word-problem generator."""

from __future__ import annotations

import re

import pytest

from medsrl.data.arithmetic import LEVELS, generate_arithmetic, space_size, split_of
from medsrl.data.example import prompt_key

STEP = re.compile(r"^(\d+) ([-+*]) (\d+) = (\d+)\.$")
WORDS = {
    "add": "+",
    "plus": "+",
    "take away": "-",
    "subtract": "-",
    "multiply by": "*",
    "times": "*",
}


def parse_problem(problem: str) -> tuple[int, list[tuple[str, int]]]:
    """Start value and (op, operand) list of a problem text."""
    assert problem.endswith(".")
    head, *ops = problem[:-1].split(", ")
    m = re.fullmatch(r"Start (?:at|with) (\d+)", head)
    assert m, head
    parsed = []
    for phrase in ops:
        m = re.fullmatch(r"(add|plus|take away|subtract|multiply by|times) (\d+)", phrase)
        assert m, phrase
        parsed.append((WORDS[m.group(1)], int(m.group(2))))
    return int(head.split()[-1]), parsed


def check_solution(ex) -> int:
    """Re-evaluate every step of the worked solution; return the number of steps."""
    body, boxed = ex.solution.rsplit(" \\boxed{", 1)
    assert boxed.endswith("}")
    assert boxed[:-1] == ex.answer
    start, ops = parse_problem(ex.problem)
    steps = re.findall(r"\d+ [-+*] \d+ = \d+\.", body)
    assert " ".join(steps) == body
    assert len(steps) == len(ops)
    value = start
    for step, (op, d) in zip(steps, ops, strict=True):
        a, sym, b, result = STEP.match(step).groups()
        assert int(a) == value and sym == op and int(b) == d
        expected = {"+": value + d, "-": value - d, "*": value * d}[op]
        assert int(result) == expected, step
        assert 0 <= expected <= 99
        value = expected
    assert str(value) == ex.answer
    return len(steps)


def test_deterministic_for_a_seed():
    a = generate_arithmetic(200, level=2, seed=3)
    b = generate_arithmetic(200, level=2, seed=3)
    c = generate_arithmetic(200, level=2, seed=4)
    assert a == b
    assert [e.problem for e in a] != [e.problem for e in c]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_solutions_are_correct_and_fields_filled(level):
    examples = generate_arithmetic(300, level=level, seed=0, split="train")
    assert len(examples) == 300
    assert len({e.problem for e in examples}) == 300
    for i, ex in enumerate(examples):
        assert ex.row == i
        assert ex.source == f"arithmetic-l{level}"
        assert ex.key == prompt_key(ex.problem)
        assert ex.answer == str(int(ex.answer))
        assert split_of(ex.problem) == "train"
        check_solution(ex)
        assert len(ex.solution) <= 80


def test_phrasing_varies():
    text = " ".join(e.problem for e in generate_arithmetic(300, level=1))
    for word in [*WORDS, "Start at", "Start with"]:
        assert word in text, word


def test_splits_are_disjoint():
    sets = {
        s: {e.problem for e in generate_arithmetic(500, level=1, seed=0, split=s)}
        for s in ("train", "val", "test")
    }
    assert not sets["train"] & sets["val"]
    assert not sets["train"] & sets["test"]
    assert not sets["val"] & sets["test"]
    # A different seed draws other problems but never crosses splits.
    other_val = {e.problem for e in generate_arithmetic(500, level=1, seed=7, split="val")}
    assert not other_val & sets["train"]


def test_levels_differ_in_op_count():
    counts = {}
    for level in sorted(LEVELS):
        counts[level] = {check_solution(e) for e in generate_arithmetic(200, level=level, seed=1)}
    assert counts[1] == {2}
    assert counts[2] == {2, 3}
    assert counts[3] == {3, 4}


def test_impossible_requests_raise():
    total = space_size(1)
    with pytest.raises(ValueError):
        generate_arithmetic(total + 1, level=1)
    # The val split holds only about a tenth of the level-1 space.
    with pytest.raises(ValueError):
        generate_arithmetic(total // 5, level=1, split="val")
    with pytest.raises(ValueError):
        generate_arithmetic(10, level=99)
    with pytest.raises(ValueError):
        generate_arithmetic(10, split="dev")


def test_fills_a_split_to_capacity():
    """Near the capacity of a small split, generation still returns distinct problems."""
    from medsrl.data.arithmetic import _enumerate_split

    capacity = len(_enumerate_split(1, "test"))
    examples = generate_arithmetic(capacity, level=1, split="test")
    assert len({e.problem for e in examples}) == capacity
    with pytest.raises(ValueError):
        generate_arithmetic(capacity + 1, level=1, split="test")
