import math

import pytest
import torch

from medsrl.algo import entropy_bonus_advantage, group_advantages


def test_single_group_hand_computed():
    # scores [1,0,0,1]: mean .5; unbiased var = 4*.25/3 = 1/3, std = .5774
    # adv = +-.5 / .5774 = +-0.8660
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]), atol=1e-5, rtol=0)
    assert abs(a - 0.8660) < 1e-4


def test_uses_unbiased_std():
    # [2,0] : mean 1, unbiased std = sqrt(2) (biased would be 1) -> adv +-1/sqrt(2)
    adv = group_advantages(torch.tensor([2.0, 0.0]), torch.tensor([3, 3]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_ragged_shuffled_groups_and_size_one():
    # group 7: [1,0,1] mean 2/3, var = (1/9+4/9+1/9)/2 = 1/3 -> std .5774
    #   adv: (1/3)/.5774 = .5774, (-2/3)/.5774 = -1.1547
    # group 42: [5,3] mean 4, std sqrt(2) -> +-0.7071
    # group -1: [9] size one -> 0
    scores = torch.tensor([1.0, 5.0, 9.0, 0.0, 3.0, 1.0])
    gids = torch.tensor([7, 42, -1, 7, 42, 7])
    adv = group_advantages(scores, gids)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([(1 / 3) / s, 1 / math.sqrt(2), 0.0, (-2 / 3) / s, -1 / math.sqrt(2),
                             (1 / 3) / s])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_matches_per_group_reference_on_random_permutation():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(30, generator=g)
    gids = torch.tensor([0] * 8 + [1] * 5 + [2] * 16 + [3])[torch.randperm(30, generator=g)] * 11
    adv = group_advantages(scores, gids)
    for gid in gids.unique():
        sel = gids == gid
        x = scores[sel]
        ref = (x - x.mean()) / (x.std() + 1e-6) if x.numel() > 1 else torch.zeros(1)
        torch.testing.assert_close(adv[sel], ref)


def test_dr_grpo_no_std():
    # group 0: [1,0,0,1] -> +-.5 ; group 1: [3,1] mean 2 -> +-1
    adv = group_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 1.0]),
                           torch.tensor([0, 1, 0, 0, 0, 1]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, 1.0, -0.5, -0.5, 0.5, -1.0]))


def test_uniform_group_gives_zero_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


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
