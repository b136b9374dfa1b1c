"""W-REINFORCE (arXiv 2506.01347) and Pass@k training's analytical advantage (arXiv 2508.10751):
hand-computed values, and Pass@k against a brute-force enumeration of every k-subset."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from medsrl.algo import AdvantageInputs, compute_advantages
from medsrl.algo.advantages import ADVANTAGE_OPTIONS, passk_advantages, w_reinforce_advantages


def _inputs(scores: list[float], groups: list[int], correct: list[float] | None = None) -> AdvantageInputs:
    s = torch.tensor(scores, dtype=torch.float64)
    terms = {"correct": torch.tensor(correct if correct is not None else scores, dtype=torch.float64)}
    return AdvantageInputs(s, torch.tensor(groups), terms, torch.ones(len(scores), 3))


# ---------------------------------------------------------------- W-REINFORCE


def test_w_reinforce_gives_lambda_to_correct_and_minus_one_to_wrong_without_baseline():
    # r in {0, 1}: A = 0.1 r - (1 - r); no group mean, so an all-wrong group still gets -1 each
    adv = compute_advantages("w_reinforce", _inputs([1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([0.1, -1.0, 0.1, -1.0, -1.0, -1.0], dtype=torch.float64))
    # lambda = 1 is plain REINFORCE on +-1 rewards
    adv = compute_advantages("w_reinforce", _inputs([1, 0], [0, 0]), positive_weight=1.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0], dtype=torch.float64))


def test_w_reinforce_keeps_shaping_terms_on_their_side():
    # correct with an overlong term -0.5: 0.1 * 0.5 = 0.05; wrong with a MEDS penalty 0.2: -1.2
    adv = compute_advantages("w_reinforce", _inputs([0.5, -0.2, 1.0], [0, 0, 0], correct=[1, 0, 1]))
    torch.testing.assert_close(adv, torch.tensor([0.05, -1.2, 0.1], dtype=torch.float64))
    # without a correctness term the score decides
    adv = w_reinforce_advantages(torch.tensor([1, 0]), torch.tensor([True, False]), positive_weight=0.25)
    assert adv.dtype == torch.float32 and adv.tolist() == [0.25, -1.0]


def test_w_reinforce_option_is_checked_and_defaults_to_the_paper():
    assert ADVANTAGE_OPTIONS["w_reinforce"]().positive_weight == 0.1  # the paper's lambda
    with pytest.raises(ValueError):
        ADVANTAGE_OPTIONS["w_reinforce"].model_validate({"positive_weight": 0})


# ---------------------------------------------------------------- Pass@k


def brute_force(scores: list[float], k: int) -> list[float]:
    """Every k-subset of the group: R the mean of their best score, sigma its std, a response's
    advantage the mean best of the subsets holding it minus R, over sigma."""
    n = len(scores)
    subsets = list(itertools.combinations(range(n), k))
    best = [max(scores[i] for i in s) for s in subsets]
    value = sum(best) / len(best)
    sigma = math.sqrt(sum((b - value) ** 2 for b in best) / len(best))
    if sigma == 0:
        return [0.0] * n
    held = [[b for s, b in zip(subsets, best, strict=True) if j in s] for j in range(n)]
    return [(sum(h) / len(h) - value) / sigma for h in held]


def closed_form(n: int, c: int, k: int) -> tuple[float, float]:
    """The paper's (correct, wrong) advantages of a group of n with c correct."""
    value = 1 - math.comb(n - c, k) / math.comb(n, k)
    sigma = math.sqrt(value * (1 - value))
    return (1 - value) / sigma, (1 - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) - value) / sigma


def _passk(scores: list[float], k: int) -> list[float]:
    return passk_advantages(torch.tensor(scores, dtype=torch.float64), torch.zeros(len(scores), dtype=torch.long),
                            k).tolist()


def test_passk_hand_computed():
    # n=4, c=2, k=2: R = 1 - C(2,2)/C(4,2) = 5/6, sigma = sqrt(5/6 * 1/6) = sqrt(5)/6;
    # correct (1/6)/sigma = 1/sqrt(5); wrong: subsets holding it are best 1 - C(1,1)/C(3,1) = 2/3
    # of the time, (2/3 - 5/6)/sigma = -1/sqrt(5)
    a = 1 / math.sqrt(5)
    assert _passk([1, 0, 1, 0], 2) == pytest.approx([a, -a, a, -a], abs=1e-12)
    # n=8, c=1, k=4: R = 1 - C(7,4)/C(8,4) = 1 - 35/70 = 1/2, sigma = 1/2; correct (1/2)/(1/2) = 1;
    # wrong: 1 - C(6,3)/C(7,3) = 1 - 20/35 = 3/7, (3/7 - 1/2)/(1/2) = -1/7
    assert _passk([0, 0, 0, 1, 0, 0, 0, 0], 4) == pytest.approx([-1 / 7] * 3 + [1.0] + [-1 / 7] * 4, abs=1e-12)
    # k = 1 is GRPO with the population std: [1,0,0,0] mean 1/4, std sqrt(3)/4 -> sqrt(3), -1/sqrt(3)
    assert _passk([1, 0, 0, 0], 1) == pytest.approx([math.sqrt(3)] + [-1 / math.sqrt(3)] * 3, abs=1e-12)


@pytest.mark.parametrize(("n", "k"), [(4, 2), (6, 3), (8, 4), (8, 1), (8, 8), (5, 4)])
def test_passk_is_the_closed_form_and_the_enumeration_on_binary_rewards(n, k):
    for c in range(n + 1):
        scores = [1.0] * c + [0.0] * (n - c)
        got = _passk(scores, k)
        assert got == pytest.approx(brute_force(scores, k), abs=1e-12), (n, c, k)
        if 0 < c and n - c >= k:  # sigma > 0: the paper's formula
            pos, neg = closed_form(n, c, k)
            assert got == pytest.approx([pos] * c + [neg] * (n - c), abs=1e-12), (n, c, k)
        else:  # every k-subset holds a correct one (or none does): no signal
            assert got == [0.0] * n
        assert sum(got) == pytest.approx(0.0, abs=1e-12)


def test_passk_shaped_scores_match_the_enumeration_and_groups_are_ragged():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = (torch.randint(0, 2, (7,), generator=gen) - 0.3 * torch.rand(7, generator=gen)).tolist()
        for k in (1, 3, 7):
            assert _passk(scores, k) == pytest.approx(brute_force(scores, k), abs=1e-9)
    # two ragged, interleaved groups with arbitrary ids; a group smaller than k is taken whole
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([5, 9, 5, 9, 5, 9, 9, 9])  # 5: [1,0,0], 9: [0,1,0,1,0]
    adv = compute_advantages("passk", AdvantageInputs(scores, groups, {"correct": scores}, torch.ones(8, 2)), k=4)
    assert adv.dtype == torch.float32
    g5 = brute_force([1.0, 0.0, 0.0], 3)  # k = n = 3: every subset holds the correct one -> 0
    g9 = brute_force([0.0, 1.0, 0.0, 1.0, 0.0], 4)
    torch.testing.assert_close(adv[groups == 5], torch.tensor(g5, dtype=torch.float32))
    torch.testing.assert_close(adv[groups == 9], torch.tensor(g9, dtype=torch.float32))


def test_passk_option_k_defaults_to_four_and_is_bounded_by_rollout_n():
    assert ADVANTAGE_OPTIONS["passk"]().k == 4
    with pytest.raises(ValueError):
        ADVANTAGE_OPTIONS["passk"].model_validate({"k": 0})
