"""The study task: order-of-operations problems and the planted left-to-right shortcut."""

import hashlib
import json
from collections import Counter

import pytest

from medsrl.data.arithmetic import split_of
from medsrl.data.precedence import (
    WRONG_ROUTES,
    add_route,
    correct_route,
    drop_route,
    generate_precedence,
    generate_precedence_mix,
    is_trap,
    parse_expression,
    planted_answers,
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


ROUTES = ("shortcut", "add", "drop")


def _digest(exs) -> str:
    rows = [[e.problem, e.answer, e.source, e.row, e.solution] for e in exs]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


@pytest.mark.parametrize(
    ("call", "digest"),
    [  # digests of the generator before wrong_routes existed: the default must not move a byte
        (dict(num=300, level=1, seed=0, split="train", shortcut_rate=0.6), "2a22d5aa643b5755"),
        (dict(num=300, level=2, seed=1, split="train", shortcut_rate=0.6), "afe8ef81f3b5f452"),
        (dict(num=100, level=1, seed=2, split="val"), "79e86181c802ddd8"),
        (dict(num=200, level=2, seed=0, split="test", shortcut_rate=0.6), "2e7cbf9e63f41b7c"),
        (dict(num=500, level=2, seed=5, split="train", shortcut_rate=1.0), "e71725b0de148e73"),
    ],
)
def test_default_wrong_routes_change_nothing(call, digest):
    assert _digest(generate_precedence(**call)) == digest
    assert _digest(generate_precedence(**call, wrong_routes=["shortcut"])) == digest


def test_default_mix_changes_nothing():
    mix = generate_precedence_mix(400, levels={1: 0.1, 2: 0.9}, seed=0, split="train", shortcut_rate=0.6,
                                  trap_fraction=0.5)
    assert _digest(mix) == "5dc87040ea842b14"


def test_wrong_routes_on_a_level_1_trap():
    nums, ops = [9, 2, 3], ["-", "*"]
    assert add_route(nums, ops).solution() == "2 + 3 = 5. 9 - 5 = 4. \\boxed{4}"
    assert drop_route(nums, ops).solution() == "2 * 3 = 6. \\boxed{6}"
    assert planted_answers("Compute 9 - 2 * 3.", ROUTES) == {"shortcut": "21", "add": "4", "drop": "6"}
    assert is_trap("Compute 9 - 2 * 3.", ROUTES)
    # 2 * 2 = 2 + 2: the add route gives the right answer, so no trap for it (still one for the shortcut)
    assert is_trap("Compute 9 - 2 * 2.") and not is_trap("Compute 9 - 2 * 2.", ROUTES)
    assert not is_trap("Compute 5 - 2 * 2.", ROUTES)  # shortcut 6, add 1, correct 1
    assert drop_route([2, 3, 4], ["+", "+"]).value == 5  # no product: the first step


def test_most_shortcut_traps_are_traps_of_every_route():
    for level, num in ((1, 200), (2, 1000)):
        traps = [e.problem for e in generate_precedence(num, level=level, seed=0, split="train") if is_trap(e.problem)]
        assert sum(is_trap(p, ROUTES) for p in traps) / len(traps) > 0.85


@pytest.mark.parametrize("level", [1, 2])
def test_several_routes_are_planted_in_fair_shares(level):
    exs = generate_precedence(1000, level=level, seed=0, split="train", shortcut_rate=0.6, wrong_routes=ROUTES)
    assert exs == generate_precedence(1000, level=level, seed=0, split="train", shortcut_rate=0.6,
                                      wrong_routes=list(ROUTES))  # deterministic, any sequence
    shares = Counter()
    for e in exs:
        nums, ops = parse_expression(e.problem)
        right = correct_route(nums, ops)
        assert e.answer == str(right.value)
        if not is_trap(e.problem, ROUTES):  # plain problems: the order does not matter
            assert shortcut_route(nums, ops).value == right.value and e.solution == right.solution()
            continue
        answers = planted_answers(e.problem, ROUTES)
        assert len({*answers.values(), e.answer}) == 4 and "None" not in answers.values()
        got = extract_last_boxed(e.solution)
        route = next((name for name, a in answers.items() if a == got), "correct")
        assert e.solution == (WRONG_ROUTES[route](nums, ops) if route in ROUTES else right).solution()
        shares[route] += 1
    assert sum(shares.values()) == 500
    assert 0.33 < shares["correct"] / 500 < 0.47
    for name in ROUTES:
        assert 0.14 < shares[name] / 500 < 0.26


def test_unknown_or_repeated_routes_are_refused():
    for bad in (["shortcut", "swap"], [], ["add", "add"]):
        with pytest.raises(ValueError, match=r"wrong_routes must be distinct names of \['add', 'drop', 'shortcut'\]"):
            generate_precedence(4, wrong_routes=bad)
    with pytest.raises(ValueError, match="wrong_routes"):
        planted_answers("Compute 9 - 2 * 3.", ["nope"])


def test_traps_are_problems_where_the_order_matters_whatever_the_routes():
    exs = generate_precedence(400, level=2, seed=0, split="train", shortcut_rate=1.0, wrong_routes=["add", "drop"])
    for e in exs:
        nums, ops = parse_expression(e.problem)
        order_matters = shortcut_route(nums, ops).value != correct_route(nums, ops).value
        assert is_trap(e.problem, ["add", "drop"]) == order_matters
        assert (extract_last_boxed(e.solution) == e.answer) != order_matters  # every trap planted
    assert not is_trap("Compute 2 * 3 + 4.", ["add", "drop"])  # add 9, drop 6, but no trap
