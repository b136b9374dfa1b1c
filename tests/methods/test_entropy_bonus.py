"""GRPO+Entropy's token-level advantage bonus as a plug-in, against hand-computed numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from medsrl.methods.entropy_bonus import EntropyBonus, entropy_bonus_advantage
from medsrl.plugins.base import StepContext
from medsrl.step.metrics import PhaseTimer


def test_bonus_is_capped_at_half_the_advantage_and_zero_on_padding():
    entropy = torch.tensor([[1.0, 0.5, 2.0], [0.25, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rollouts = SimpleNamespace(token_stats={"entropy": entropy}, packed=SimpleNamespace(response_mask=mask))
    ctx = StepContext(0, None, PhaseTimer(), 2)
    adv = torch.tensor([0.6, -1.0])
    out = EntropyBonus(coef=0.4, cap_ratio=0.5).shape_advantages(rollouts, adv, ctx)
    # row 0, A = 0.6, cap 0.3: 0.4*1.0=0.4 -> 0.3; 0.4*0.5=0.2; 0.4*2.0=0.8 -> 0.3
    # row 1, A = -1.0, cap 0.5: 0.4*0.25=0.1; 0.4*3.0=1.2 -> 0.5; padding -> 0
    expected = torch.tensor([[0.9, 0.8, 0.9], [-0.9, -0.5, 0.0]])
    torch.testing.assert_close(out, expected)
    # bonus over the 5 real tokens: (0.3 + 0.2 + 0.3 + 0.1 + 0.5) / 5 = 0.28; 3 of 5 capped
    assert ctx.metrics["entropy_bonus/bonus_mean"] == pytest.approx(0.28)
    assert ctx.metrics["entropy_bonus/capped_frac"] == pytest.approx(0.6)


def test_asks_for_the_entropy_of_the_scoring_forward():
    assert EntropyBonus.token_stats == ("entropy",)


def test_entropy_bonus_hand_computed():
    # A = [1, -1, 0] broadcast over T=2; H = [[0.5, 3], [2, 0.1], [1, 1]], coef .4, cap .5
    # seq0: min(.2, .5)=.2 -> 1.2 ; min(1.2, .5)=.5 -> 1.5
    # seq1: min(.8, .5)=.5 -> -.5 ; min(.04, .5)=.04 -> -.96
    # seq2: |A|=0 caps the bonus at 0 -> 0, 0
    adv = torch.tensor([1.0, -1.0, 0.0])
    ent = torch.tensor([[0.5, 3.0], [2.0, 0.1], [1.0, 1.0]], requires_grad=True)
    out = entropy_bonus_advantage(adv, ent)
    torch.testing.assert_close(out, torch.tensor([[1.2, 1.5], [-0.5, -0.96], [0.0, 0.0]]))
    assert not out.requires_grad  # entropy is detached
    # [B,T] advantages give the same result as the broadcast [B]
    torch.testing.assert_close(entropy_bonus_advantage(adv[:, None].expand(3, 2), ent), out)
