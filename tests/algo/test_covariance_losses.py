"""clip_cov and kl_cov on 2 x 2 token tables, numbers worked by hand."""

import math

import pytest
import torch

from medsrl.algo import compute_policy_loss, token_covariance
from medsrl.algo.settings import AlgorithmConfig

MASK = torch.ones(2, 2)
ADV = torch.tensor([2.0, -2.0])  # per sequence: tokens of row 0 get 2, of row 1 get -2


def test_token_covariance():
    logp = torch.tensor([[-1.0, -3.0], [-1.5, -2.5]])  # mean -2
    # (A - 0) * (logp + 2): [[2 * 1, 2 * -1], [-2 * 0.5, -2 * -0.5]]
    assert token_covariance(ADV, logp, MASK).tolist() == [[2.0, -2.0], [-1.0, 1.0]]
    masked = token_covariance(ADV, logp, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    # means over 3 tokens: A 2/3, logp -5.5/3
    assert masked[0, 0].item() == pytest.approx((2 - 2 / 3) * (-1 + 5.5 / 3))


def _clip_cov(logp, old, **kw):
    return compute_policy_loss("clip_cov", logp, old, ADV, MASK, clip_low=0.2, clip_high=0.2, dual_clip=None, **kw)


def test_clip_cov_zeroes_tokens_in_the_covariance_band():
    logp = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]])  # cov [[2, -2], [-2, 2]]
    out = _clip_cov(logp, logp.clone(), clip_cov_ratio=0.5)  # 2 tokens; both candidates (cov 2)
    # ratio 1: loss -A = [[-2, -2], [2, 2]]; the two band tokens get 0
    assert out.loss_mat.tolist() == [[0.0, -2.0], [2.0, 0.0]]
    assert out.extra["cov_clipped_frac"].item() == 0.5 and out.extra["cov_candidate_frac"].item() == 0.5
    one = _clip_cov(logp, logp.clone())  # verl's 0.0002: max(1, 0) = one token, drawn
    assert (one.loss_mat == 0).sum().item() == 1 and one.extra["cov_clipped_frac"].item() == 0.25
    assert torch.equal(one.loss_mat, _clip_cov(logp, logp.clone()).loss_mat)  # seeded
    # the band is open: cov 2 is outside (2, 5)
    assert (_clip_cov(logp, logp.clone(), clip_cov_lb=2.0).loss_mat != 0).all()


def test_clip_cov_leaves_tokens_ppo_already_clipped():
    logp = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -3.0], [-1.0, -3.0]])  # token (0, 0): ratio e^0.5 > 1.2, A > 0
    out = _clip_cov(logp, old, clip_cov_ratio=0.5)
    assert out.loss_mat[0, 0].item() == pytest.approx(-2 * 1.2)  # clipped, kept
    assert out.loss_mat[1, 1].item() == 0.0  # the other band token, zeroed
    out.loss_mat.sum().backward()
    assert logp.grad[1, 1].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(-2.0)


def test_kl_cov_penalises_the_largest_covariance_without_clipping():
    logp = torch.tensor([[-1.0, -3.0], [-1.5, -2.5]], requires_grad=True)  # cov [[2, -2], [-1, 1]]
    old = torch.tensor([[-1.1, -3.0 - math.log(2)], [-1.5, -2.5]])
    out = compute_policy_loss("kl_cov", logp, old, ADV, MASK,
                              kl_cov_ratio=0.25, ppo_kl_coef=0.1)  # max(1, int(1)) = 1 token: (0, 0)
    want = [[-2 * math.exp(0.1) + 0.1 * 0.1, -2 * 2.0], [2.0, 2.0]]  # (0, 1): ratio 2, not clipped
    assert out.loss_mat.tolist() == [pytest.approx(r) for r in want]
    assert out.extra["kl_penalised_frac"].item() == 0.25 and out.clipfrac.item() == 0
    out.loss_mat.sum().backward()
    assert logp.grad[0, 0].item() == pytest.approx(-2 * math.exp(0.1) + 0.1)


def test_bad_settings_are_refused():
    logp = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        _clip_cov(logp, logp, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio is not a setting of policy_loss 'clip_cov'"):
        AlgorithmConfig(policy_loss="clip_cov", policy_loss_options={"kl_cov_ratio": 0.1})
