"""Which route a response to a study problem took, and whether MEDS's clusters follow the routes.

A wrong answer alone does not say how a policy went wrong: ``route_of`` reads the response's
"x op y = z." steps and its boxed answer and names the route (``medsrl.data.precedence``):

* ``correct``: the boxed answer is the right one (the grader's verdict, whatever the steps);
* a planted route's name (``shortcut``, ``add``, ``drop``): its exact steps and its answer;
* ``slip@j``: the j-th written step (1-based) has a wrong result, the steps before it right;
* ``grouping``: a whole evaluation in another order: each step works two neighbouring terms of
  the expression as it stands (its numbers, its operator, its result right) until one number is
  left, which is boxed, in an order neither the correct route's nor a named route's;
* ``no_box``: no boxed answer; ``other``: anything else (no steps, numbers miscopied, a stop
  half-way, a box unlike the steps).

``cluster_route_agreement`` asks whether the clusters of a prompt's responses are its routes;
``route_diversity`` counts the routes a policy keeps per prompt.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from sklearn.metrics import adjusted_rand_score

from medsrl.data.arithmetic import apply_op
from medsrl.data.precedence import WRONG_ROUTES, correct_route, parse_expression
from medsrl.reward.extract import extract_last_boxed

_STEP = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)\s*\.")
_BOX = re.compile(r"\\(?:boxed|fbox)")

Step = tuple[int, str, int, int]


def parse_steps(text: str) -> list[Step]:
    """The ``(x, op, y, z)`` of each "x op y = z." sentence, in order (before any box)."""
    box = _BOX.search(text)
    body = text[: box.start()] if box else text
    return [(int(x), op, int(y), int(z)) for x, op, y, z in _STEP.findall(body)]


def route_of(problem: str, response: str) -> str:
    """The route ``response`` took on ``problem`` (labels in the module docstring). Correctness
    comes first so the labels of wrong responses partition the errors; slips come before
    ``grouping`` because one wrong step makes any order of operations unreadable."""
    answer = extract_last_boxed(response)
    if answer is None:
        return "no_box"
    answer = answer.strip()
    nums, ops = parse_expression(problem)
    if answer == str(correct_route(nums, ops).value):
        return "correct"
    steps = parse_steps(response)
    for name, route in WRONG_ROUTES.items():
        taken = route(nums, ops)
        if taken.value is not None and answer == str(taken.value) and steps == parse_steps(" ".join(taken.lines)):
            return name
    for j, (x, op, y, z) in enumerate(steps, start=1):
        if apply_op(op, x, y) != z:
            return f"slip@{j}"
    return "grouping" if _reduces(nums, ops, steps) == answer else "other"


def _reduces(nums: Sequence[int], ops: Sequence[str], steps: Sequence[Step]) -> str | None:
    """The number ``steps`` reduce the expression to, each step replacing two neighbouring terms
    by its result; None when a step matches no neighbours or more than one number is left."""
    nums, ops = list(nums), list(ops)
    for x, op, y, z in steps:
        at = [i for i in range(len(ops)) if (nums[i], ops[i], nums[i + 1]) == (x, op, y)]
        if not at:
            return None
        nums[at[0] : at[0] + 2] = [z]
        del ops[at[0]]
    return str(nums[0]) if not ops else None


def _purity(clusters: Sequence[Hashable], routes: Sequence[str]) -> float:
    """Share of responses that take their cluster's most frequent route."""
    by_cluster: dict[Hashable, list[str]] = defaultdict(list)
    for c, r in zip(clusters, routes, strict=True):
        by_cluster[c].append(r)
    return sum(Counter(rs).most_common(1)[0][1] for rs in by_cluster.values()) / len(routes)


def cluster_route_agreement(
    groups: Sequence[Hashable], labels: Sequence[int], routes: Sequence[str]
) -> dict[str, float]:
    """How well clusters (``labels``, -1 = noise, as HDBSCAN gives them) match ``routes``, per
    group (prompt, ``groups``) over its clustered responses, averaged over the groups with 2 or
    more of them: ``purity`` and ``ari`` (adjusted Rand index), and ``purity_single`` and
    ``ari_single`` for one cluster per prompt, the baseline clusters must beat (a prompt whose
    responses all take one route is pure either way). ``groups`` counts the groups averaged."""
    members: dict[Hashable, list[tuple[int, str]]] = defaultdict(list)
    for g, c, r in zip(groups, labels, routes, strict=True):
        if c != -1:
            members[g].append((c, r))
    scores: dict[str, list[float]] = defaultdict(list)
    for pairs in members.values():
        if len(pairs) < 2:
            continue
        clusters, rs = [c for c, _ in pairs], [r for _, r in pairs]
        single = [0] * len(rs)
        scores["purity"].append(_purity(clusters, rs))
        scores["ari"].append(adjusted_rand_score(rs, clusters))
        scores["purity_single"].append(_purity(single, rs))
        scores["ari_single"].append(adjusted_rand_score(rs, single))
    keys = ("purity", "ari", "purity_single", "ari_single")
    out = {k: float(np.mean(scores[k])) if scores[k] else float("nan") for k in keys}
    return {**out, "groups": float(len(scores["purity"]))}


def route_diversity(
    routes_per_prompt_per_step: Mapping[Hashable, Mapping[Hashable, Sequence[str]]],
) -> tuple[float, float]:
    """``(within_step, across_step)`` from ``{step: {prompt: [route, ...]}}``: the mean number of
    distinct routes of a prompt's responses at one step (over the (step, prompt) pairs), and of
    all its responses over every step (over the prompts). A policy that keeps several ways open
    scores high on both; one that switches between single routes only across steps."""
    within: list[int] = []
    over: dict[Hashable, set[str]] = defaultdict(set)
    for per_prompt in routes_per_prompt_per_step.values():
        for prompt, routes in per_prompt.items():
            within.append(len(set(routes)))
            over[prompt].update(routes)
    if not within:
        return float("nan"), float("nan")
    return float(np.mean(within)), float(np.mean([len(s) for s in over.values()]))
