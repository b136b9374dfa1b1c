"""STEER's Omega and its linear map to [0.8, 1.2], on a 2 x 2 table by hand."""

import math

import pytest
import torch

from medsrl.methods.steer import steer_omega, steer_weights

ADV = torch.tensor([1.0, -2.0])
OLD_LOGP = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5), 0.0]])  # pi 0.5, 0.25; 0.5, 1
ENTROPY = torch.tensor([[0.5, 1.0], [0.2, 0.3]])
MASK = torch.ones(2, 2)


def test_omega_by_hand():
    omega = steer_omega(ADV, OLD_LOGP, ENTROPY)
    want = [
        [1 * 0.5 * abs(math.log(0.5) + 0.5), 1 * 0.75 * abs(math.log(0.25) + 1.0)],  # 0.0966, 0.2897
        [2 * 0.5 * abs(math.log(0.5) + 0.2), 0.0],  # 0.4931; pi = 1: nothing to move
    ]
    assert omega.tolist() == [pytest.approx(r, rel=1e-5) for r in want]


def test_weights_map_the_largest_omega_to_low():
    omega = steer_omega(ADV, OLD_LOGP, ENTROPY)
    w = steer_weights(omega, MASK)
    top = 2 * 0.5 * abs(math.log(0.5) + 0.2)
    want = [[1.2 - 0.4 * 0.5 * abs(math.log(0.5) + 0.5) / top, 1.2 - 0.4 * 0.75 * abs(math.log(0.25) + 1.0) / top],
            [0.8, 1.2]]
    assert w.tolist() == [pytest.approx(r, rel=1e-5) for r in want]  # [[1.1217, 0.9650], [0.8, 1.2]]


def test_padding_bounds_and_no_spread():
    omega = torch.tensor([[1.0, 9.0], [3.0, 5.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    w = steer_weights(omega, mask)  # 9.0 is padding: range 1..5
    assert w.tolist() == [pytest.approx(r) for r in [[1.2, 1.0], [1.0, 0.8]]]
    # bounds from every rank's tokens: 0..10
    assert steer_weights(omega, mask, bounds=(0.0, 10.0))[1].tolist() == pytest.approx([1.08, 1.0])
    assert torch.equal(steer_weights(torch.full((2, 2), 3.0), MASK), torch.ones(2, 2))
    with pytest.raises(ValueError, match="low <= high"):
        steer_weights(omega, mask, low=1.3, high=1.2)
