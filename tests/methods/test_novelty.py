"""EVOL-RL's novelty rule on a group of 4 with known vectors, by hand."""

import math

import pytest
import torch

from medsrl.methods.novelty import group_novelty, minmax_within, novelty_rewards

# right: a = (1, 0), b = (1, 1); wrong: c = (0, 1), d = (-1, 0)
VECS = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
RIGHT = torch.tensor([True, True, False, False])
S = 1 / math.sqrt(2)  # cos 45 degrees
# cos: a-b S, a-c 0, a-d -1, b-c S, b-d -S, c-d 0
NOVELTY = [
    1 - (0.5 * S + 0.5 * S),  # a: same-outcome mean cos(a,b) = S; max over b, c, d = S
    1 - (0.5 * S + 0.5 * S),  # b: cos(b,a) = S; max S
    1 - (0.5 * 0 + 0.5 * S),  # c: cos(c,d) = 0; max cos(c,b) = S
    1 - (0.5 * 0 + 0.5 * 0),  # d: cos(d,c) = 0; max over a (-1), b (-S), c (0) = 0
]


def test_group_novelty():
    assert group_novelty(VECS, RIGHT).tolist() == pytest.approx(NOVELTY)
    assert group_novelty(VECS[:1], RIGHT[:1]).tolist() == [1.0]


def test_rewards_map_right_to_upper_and_wrong_to_lower_range():
    ones = torch.ones(4, dtype=torch.bool)
    r = novelty_rewards(VECS, RIGHT, ones, ones)
    # right: a and b tie -> no spread -> u = 0.5 -> 0.75; wrong: c lowest (u 0), d highest (u 1)
    assert r.tolist() == pytest.approx([0.75, 0.75, -1.0, -0.5])
    no_box = torch.tensor([True, True, True, False])
    assert novelty_rewards(VECS, RIGHT, no_box, ones)[3].item() == -1.0
    # c without a vector: d is the only wrong one left (u 0.5), c gets the bottom (-1)
    has_vec = torch.tensor([True, True, False, True])
    assert novelty_rewards(VECS, RIGHT, ones, has_vec).tolist() == pytest.approx([0.75, 0.75, -1.0, -0.75])


def test_minmax_within():
    x = torch.tensor([1.0, 3.0, 2.0, 5.0], dtype=torch.float64)
    sub = torch.tensor([True, True, True, False])
    assert minmax_within(x, sub).tolist() == [0.0, 1.0, 0.5, 0.0]
    assert minmax_within(x, torch.tensor([False, False, False, True])).tolist() == [0, 0, 0, 0.5]
