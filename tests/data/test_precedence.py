"""The study task: order-of-operations problems and the planted left-to-right shortcut."""

import pytest

from medsrl.data.arithmetic import split_of
from medsrl.data.precedence import (
    correct_route,
    generate_precedence,
    generate_precedence_mix,
    is_trap,
    parse_expression,
    shortcut_answer,
    shortcut_route,
)
from medsrl.reward.extract import extract_last_boxed


def test_routes_on_a_trap():
    assert correct_route([3, 4, 2], ["+", "*"]).solution() == "4 * 2 = 8. 3 + 8 = 11. \\boxed{11}"
    assert shortcut_route([3, 4, 2], ["+", "*"]).solution() == "3 + 4 = 7. 7 * 2 = 14. \\boxed{14}"
    assert is_trap("Compute 3 + 4 * 2.")
    assert shortcut_answer("Compute 3 + 4 * 2.") == "14"


def test_routes_agree_without_a_trap():
    for problem in ("Compute 2 * 8 + 9.", "Evaluate 2 + 3 + 2.", "Compute 9 - 2 - 3.", "Compute 2 * 3 * 4."):
        assert not is_trap(problem)
    # multiplication first, then + and - left to right
    assert correct_route([2, 3, 4, 5], ["+", "*", "-"]).value == 9
    assert correct_route([9, 2, 3, 4], ["-", "+", "*"]).value == 19
    assert shortcut_route([9, 2, 3, 4], ["-", "+", "*"]).value == 40


def test_out_of_range_routes_have_no_value():
    assert correct_route([1, 2, 3], ["-", "*"]).value is None  # 1 - 6 < 0
    assert shortcut_route([9, 9, 9, 9], ["*", "+", "*"]).value is None  # 81 + 9 = 90, 90 * 9 > 99


def test_parse_rejects_other_text():
    assert parse_expression("Evaluate 5 - 3 * 1.") == ([5, 3, 1], ["-", "*"])
    with pytest.raises(ValueError, match="not an order-of-operations problem"):
        parse_expression("Start at 5, add 3.")


@pytest.mark.parametrize("level", [1, 2])
def test_generated_problems(level):
    exs = generate_precedence(200, level=level, seed=3, split="train")
    assert len({e.problem for e in exs}) == 200
    assert sum(is_trap(e.problem) for e in exs) == 100  # trap_fraction 0.5
    for e in exs:
        nums, ops = parse_expression(e.problem)
        assert len(ops) == level + 1
        right = correct_route(nums, ops)
        assert e.answer == str(right.value) and e.solution == right.solution()
        assert split_of(e.problem) == "train" and e.source == f"precedence-l{level}"
    assert generate_precedence(200, level=level, seed=3, split="train") == exs  # deterministic


def test_splits_are_disjoint():
    test = {e.problem for e in generate_precedence(100, level=1, split="test")}
    train = {e.problem for e in generate_precedence(1000, level=1, split="train")}
    assert not test & train


def test_shortcut_rate_plants_the_habit_on_traps_only():
    exs = generate_precedence(1000, level=2, seed=0, split="train", shortcut_rate=0.6)
    traps = [e for e in exs if is_trap(e.problem)]
    by_shortcut = [e for e in traps if extract_last_boxed(e.solution) == shortcut_answer(e.problem)]
    assert 0.5 < len(by_shortcut) / len(traps) < 0.7
    for e in exs:  # answers stay correct; non-traps are always worked the right way
        assert e.answer == str(correct_route(*parse_expression(e.problem)).value)
        if not is_trap(e.problem):
            assert extract_last_boxed(e.solution) == e.answer
    plain = generate_precedence(1000, level=2, seed=0, split="train")
    assert [e.problem for e in plain] == [e.problem for e in exs]  # same problems, other solutions


def test_mix_and_bad_arguments():
    mix = generate_precedence_mix(100, levels={1: 0.25, 2: 0.75}, seed=0, split="val")
    assert [e.source for e in mix].count("precedence-l1") == 25 and [e.row for e in mix] == list(range(100))
    with pytest.raises(ValueError, match="unknown precedence level"):
        generate_precedence(1, level=3)
    with pytest.raises(ValueError, match="shortcut_rate"):
        generate_precedence(1, shortcut_rate=1.5)
    with pytest.raises(ValueError, match="could not draw"):
        generate_precedence(5000, level=1, split="test")  # the level-1 test split is small
