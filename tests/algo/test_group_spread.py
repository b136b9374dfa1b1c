import torch

from medsrl.algo import keep_mask_by_group_spread, zero_spread_groups


def test_zero_spread_detection_shuffled_ragged():
    # group 2: [1,1] zero spread; group 5: [0,1] spread; group 7: [.5,.5,.5] zero; group 9: single
    scores = torch.tensor([1.0, 0.5, 0.0, 3.0, 0.5, 1.0, 1.0, 0.5])
    gids = torch.tensor([2, 7, 5, 9, 7, 5, 2, 7])
    zs = zero_spread_groups(scores, gids)
    assert zs.tolist() == [True, True, False, True, True, False, True, True]
    assert keep_mask_by_group_spread(scores, gids).tolist() == [not z for z in zs.tolist()]


def test_atol():
    scores = torch.tensor([1.0, 1.0 + 1e-4, 0.0, 1.0])
    gids = torch.tensor([0, 0, 1, 1])
    assert zero_spread_groups(scores, gids).tolist() == [False, False, False, False]
    assert zero_spread_groups(scores, gids, atol=1e-3).tolist() == [True, True, False, False]


def test_integer_scores():
    assert zero_spread_groups(torch.tensor([1, 1, 0, 1]), torch.tensor([0, 0, 1, 1])).tolist() == [
        True, True, False, False]

