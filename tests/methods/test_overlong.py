"""DAPO overlong penalty, against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from medsrl.methods.overlong import overlong_penalty


def test_linear_ramp_over_the_buffer() -> None:
    # max 16, buffer 4: free up to 12, then -1/4 per token, -1 at 16, clamped beyond.
    lengths = torch.tensor([0, 10, 12, 13, 14, 15, 16, 20])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, 16, 4), expected)


def test_penalty_factor_scales_and_clamps() -> None:
    # max 100, buffer 20, factor 0.5: len 90 is halfway into the buffer -> -0.25.
    lengths = torch.tensor([[80, 90], [100, 150]])
    out = overlong_penalty(lengths, 100, 20, penalty_factor=0.5)
    assert out.shape == (2, 2)
    assert torch.allclose(out, torch.tensor([[0.0, -0.25], [-0.5, -0.5]]))


def test_short_responses_get_exactly_zero() -> None:
    out = overlong_penalty(torch.tensor([1, 5]), 16, 4)
    assert out.dtype == torch.float32
    assert not torch.signbit(out).any()  # +0.0, not -0.0


def test_zero_buffer_is_a_step_at_the_limit() -> None:
    out = overlong_penalty(torch.tensor([16, 17]), 16, 0, penalty_factor=2.0)
    assert torch.equal(out, torch.tensor([0.0, -2.0]))


def test_rejects_buffer_longer_than_limit() -> None:
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 16, 17)
