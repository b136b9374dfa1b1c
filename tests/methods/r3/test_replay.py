"""CCR's mixed-group advantage, replay size and truncated importance weights, by hand."""

import math

import pytest
import torch

from medsrl.algo import group_advantages
from medsrl.algo.engine_correction import truncated_is_weights
from medsrl.methods.r3.replay import mixed_group_advantages, replay_count

# three sampled wrong responses + one replayed right one: mean 0.25, unbiased std 0.5
SCORES = torch.tensor([0.0, 0.0, 0.0, 1.0])
ONE_GROUP = torch.zeros(4, dtype=torch.long)


def test_mixed_group_formula():
    adv = mixed_group_advantages(SCORES, ONE_GROUP, alpha=2.0, lam=0.5)  # / (2 * 0.5 + 0.5)
    assert adv.tolist() == pytest.approx([-1 / 6, -1 / 6, -1 / 6, 0.5])
    adv = mixed_group_advantages(SCORES, ONE_GROUP, alpha=0.0, lam=0.5)  # / 0.5
    assert adv.tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5])


def test_alpha_1_is_grpo():
    adv = mixed_group_advantages(SCORES, ONE_GROUP, alpha=1.0, lam=1e-6)
    assert adv.tolist() == pytest.approx([-0.25 / 0.500001] * 3 + [0.75 / 0.500001], rel=1e-6)
    ids = torch.tensor([0, 0, 1, 1, 1, 0])
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0])
    assert torch.allclose(mixed_group_advantages(scores, ids), group_advantages(scores, ids, eps=1e-6))


def test_settings_refused():
    with pytest.raises(ValueError, match="alpha"):
        mixed_group_advantages(SCORES, ONE_GROUP, alpha=-1.0)
    with pytest.raises(ValueError, match="lambda"):
        mixed_group_advantages(SCORES, ONE_GROUP, lam=0.0)


def test_replay_count():
    assert replay_count(None, 8) == 2
    assert replay_count(None, 3) == 1  # at least one
    assert replay_count(5, 8) == 5
    assert replay_count(0, 8) == 0


def test_truncated_importance_weights():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    behaviour = torch.tensor([[-1.5, -1.0, -7.0]])
    mask = torch.tensor([[1, 1, 0]])
    w = truncated_is_weights(old, behaviour, cap=1.5, mask=mask)
    # exp(0.5) = 1.65 -> capped at 1.5; exp(-1) = 0.368; padding -> 1
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-1.0), 1.0])
    assert truncated_is_weights(old, behaviour, cap=2.0, mask=mask).tolist()[0][0] == pytest.approx(math.exp(0.5))
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, behaviour, cap=0.0, mask=mask)
