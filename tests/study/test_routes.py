"""Route labels of responses to the study task, and the agreement of clusters with them."""

import math

import pytest
from studies.routes import cluster_route_agreement, parse_steps, route_diversity, route_of

from medsrl.data.precedence import generate_precedence, is_trap

Q = "Compute 9 - 2 * 3."  # correct 3, shortcut 21, add 4, drop 6


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("2 * 3 = 6. 9 - 6 = 3. \\boxed{3}", "correct"),
        ("\\boxed{3}", "correct"),  # the grader's verdict, whatever the steps
        ("9 - 2 = 7. 7 * 3 = 21. \\boxed{21}", "shortcut"),
        ("2 + 3 = 5. 9 - 5 = 4. \\boxed{4}", "add"),
        ("2 * 3 = 6. \\boxed{6}", "drop"),
        ("2 * 3 = 7. 9 - 7 = 2. \\boxed{2}", "slip@1"),
        ("9 - 2 = 7. 7 * 3 = 24. \\boxed{24}", "slip@2"),
        ("9 - 2 = 7. \\boxed{7}", "other"),  # right arithmetic, a stop half-way
        ("2 * 3 = 6. 9 + 6 = 15. \\boxed{15}", "other"),  # an operator miscopied
        ("3 * 3 = 9. 9 - 9 = 0. \\boxed{0}", "other"),  # a number miscopied
        ("9 - 2 = 7. 7 * 3 = 21. The answer is 21.", "no_box"),
        ("\\boxed{42}", "other"),
        ("9 - 2 = 7. 7 * 3 = 21. \\boxed{20}", "other"),  # a box unlike the steps
    ],
)
def test_route_labels(response, label):
    assert route_of(Q, response) == label


def test_a_named_route_needs_its_steps_and_its_answer():
    # the shortcut's answer reached by other (right) steps is not the shortcut
    assert route_of(Q, "3 * 7 = 21. \\boxed{21}") == "other"
    # the level-2 routes
    problem = "Compute 3 + 8 * 4 - 5."  # correct 30, shortcut 39, add 10, drop 32
    assert route_of(problem, "3 + 8 = 11. 11 * 4 = 44. 44 - 5 = 39. \\boxed{39}") == "shortcut"
    assert route_of(problem, "8 + 4 = 12. 3 + 12 = 15. 15 - 5 = 10. \\boxed{10}") == "add"
    assert route_of(problem, "8 * 4 = 32. \\boxed{32}") == "drop"
    assert route_of(problem, "8 * 4 = 32. 3 + 32 = 35. 35 - 5 = 30. \\boxed{30}") == "correct"


def test_grouping_is_a_whole_evaluation_in_another_order():
    problem = "Compute 9 - 2 * 3 + 1."  # correct 4, shortcut 22, add 5, drop 6
    assert route_of(problem, "2 * 3 = 6. 6 + 1 = 7. 9 - 7 = 2. \\boxed{2}") == "grouping"
    assert route_of(problem, "2 * 3 = 6. 6 + 1 = 7. \\boxed{7}") == "other"  # not to the end
    assert route_of(problem, "2 * 3 = 6. 6 + 1 = 7. 9 - 7 = 2. \\boxed{7}") == "other"  # another box
    assert route_of(problem, "2 * 3 = 6. 6 + 1 = 7. 9 - 7 = 3. \\boxed{3}") == "slip@3"


def test_corpus_solutions_are_labelled_by_their_route():
    routes = ("shortcut", "add", "drop")
    exs = generate_precedence(300, level=2, seed=1, split="train", shortcut_rate=0.6, wrong_routes=routes)
    labels = {route_of(e.problem, e.solution) for e in exs if is_trap(e.problem, routes)}
    assert labels == {"correct", *routes}
    assert {route_of(e.problem, e.solution) for e in exs if not is_trap(e.problem, routes)} == {"correct"}


def test_parse_steps():
    assert parse_steps("2 * 3 = 6. 9 - 6=3 . \\boxed{3} 1 + 1 = 2.") == [(2, "*", 3, 6), (9, "-", 6, 3)]


def test_cluster_route_agreement():
    groups = ["a"] * 4 + ["b"] * 4 + ["c"]  # c: one response, not averaged
    labels = [0, 0, 1, 1, 0, 0, 1, -1, 0]  # b's noise point left out
    routes = ["shortcut", "shortcut", "add", "add", "drop", "add", "add", "drop", "add"]
    got = cluster_route_agreement(groups, labels, routes)
    assert got["groups"] == 2
    assert got["purity"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert got["purity_single"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert got["ari_single"] == 0.0
    assert got["ari"] == pytest.approx((1.0 - 0.5) / 2)  # b: {drop, add} | {add}, worse than chance
    assert math.isnan(cluster_route_agreement(["a"], [0], ["add"])["purity"])


def test_route_diversity():
    per_step = {
        0: {"p": ["shortcut", "shortcut", "correct"], "q": ["add"]},
        1: {"p": ["drop"], "q": ["add", "correct"]},
    }
    within, across = route_diversity(per_step)
    assert within == pytest.approx((2 + 1 + 1 + 2) / 4)
    assert across == pytest.approx((3 + 2) / 2)
    assert all(math.isnan(v) for v in route_diversity({}))
