import math

import pytest
import torch

from medsrl.algo import aggregate_loss, compute_policy_loss
from medsrl.algo.engine_correction import truncated_is_stats, truncated_is_weights


def test_weights_are_the_capped_ratio_of_trainer_to_engine_probabilities():
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    engine = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)]])
    w = truncated_is_weights(old, engine, cap=2.0)
    # 0.5/0.25 = 2 (at the cap), 0.2/0.4 = 0.5, 0.9/0.1 = 9 -> 2
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 2.0], rel=1e-6)
    assert w.dtype == torch.float32 and not w.requires_grad
    stats = truncated_is_stats(w, torch.tensor([[1.0, 1.0, 0.0]]), cap=2.0)
    assert stats == pytest.approx({"weight_mean": 1.25, "capped_frac": 0.5})
    assert truncated_is_stats(w, torch.zeros(1, 3), cap=2.0) == {}


def test_weights_multiply_the_policy_gradient_term_per_token():
    """On-policy (ratio 1, no clipping) the token loss is -A * ratio; weighted, -w * A * ratio:
    the gradient of token t is scaled by w_t exactly."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach()
    engine = old + torch.tensor([[0.0, math.log(2.0), -math.log(4.0)]])  # ratios 1, 0.5, 4
    adv = torch.tensor([1.5])
    mask = torch.ones(1, 3)
    w = truncated_is_weights(old, engine, cap=3.0)  # 1, 0.5, 3
    pl = compute_policy_loss("vanilla", logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=None)
    loss = aggregate_loss(pl.loss_mat * w, mask, "token-mean")
    loss.backward()
    # d/dlogp of -A * exp(logp - old) at logp = old is -A, times w, over 3 tokens
    assert logp.grad[0].tolist() == pytest.approx([-1.5 / 3, -0.75 / 3, -4.5 / 3], rel=1e-6)
    assert float(loss.detach()) == pytest.approx(-1.5 * (1 + 0.5 + 3) / 3, rel=1e-6)


def test_a_non_positive_cap_is_refused():
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(torch.zeros(1), torch.zeros(1), cap=0.0)
