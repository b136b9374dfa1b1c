"""Lp-Reg's proxy, token choice and penalty on a 3-token vocabulary, numbers worked by hand."""

import math

import pytest
import torch

from medsrl.algo import compute_policy_loss, lowest_fraction, proxy_logprobs, register_policy_loss
from medsrl.algo.policy_loss import policy_loss_reducers

PROBS = torch.tensor([0.7, 0.29, 0.01])  # one position, 3 tokens


def _logits(rows: int = 1) -> torch.Tensor:
    return PROBS.log().expand(1, rows, 3).clone()


def test_proxy_renormalises_over_tokens_above_tau():
    got = proxy_logprobs(_logits(3), torch.tensor([[0, 1, 2]]), tau=0.02)
    # tokens 0 and 1 are above 0.02: Z = 0.99; token 2 (0.01) is noise, outside the proxy
    assert got[0, 0].item() == pytest.approx(math.log(0.7 / 0.99))
    assert got[0, 1].item() == pytest.approx(math.log(0.29 / 0.99))
    assert got[0, 2].item() == float("-inf")
    assert got[0, 1].item() > math.log(0.29)  # a rare but plausible token gains mass


def test_proxy_min_p_form_is_relative_to_the_top_token():
    # tau 0.5 of max 0.7 = 0.35: only token 0 stays, with all the mass
    got = proxy_logprobs(_logits(2), torch.tensor([[0, 1]]), tau=0.5, relative=True)
    assert got[0, 0].item() == pytest.approx(0.0, abs=1e-6) and got[0, 1].item() == float("-inf")


def test_reducer_is_built_from_the_loss_options():
    reducers = policy_loss_reducers("lp_reg", {"tau": 0.5, "tau_relative": True, "beta": 2.0})
    assert set(reducers) == {"proxy_logp"}
    got = reducers["proxy_logp"](_logits(2), torch.tensor([[0, 1]]))
    assert got[0, 1].item() == float("-inf")
    assert policy_loss_reducers("vanilla", {}) == {}
    with pytest.raises(ValueError, match="tau must be in"):
        policy_loss_reducers("lp_reg", {"tau": 1.5})


def test_lowest_fraction():
    vals = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -2.0, -2.0]])
    eligible = torch.tensor([[True, True, True], [False, True, True]])
    # 5 eligible, frac 0.5 -> int(2.5) = 2: -2.0 at (0, 1) and the earlier -2.0 at (1, 1)
    assert lowest_fraction(vals, eligible, 0.5).tolist() == [[False, True, False], [False, True, False]]
    assert lowest_fraction(vals, eligible, 0.01).sum() == 1  # at least one
    assert not lowest_fraction(vals, torch.zeros_like(eligible), 0.5).any()


ADV = torch.tensor([1.0, -1.0])
MASK = torch.ones(2, 3)


def _loss(logp, proxy, **kw):
    opts = dict(clip_low=1.0, clip_high=9.0, dual_clip=None, tau=0.02, bottom_frac=0.5, beta=1.0) | kw
    return compute_policy_loss("lp_reg", logp, logp.detach().clone(), ADV, MASK, proxy_logp=proxy, **opts)


def test_lp_reg_penalises_the_lowest_negative_token_below_its_proxy():
    logp = torch.tensor([[-1.0, -3.0, -0.2], [-0.5, -2.0, -1.0]], requires_grad=True)
    q = math.log(0.29 / 0.99)
    proxy = torch.tensor([[-0.1, -0.1, -0.1], [-0.3, q, -1.5]])
    out = _loss(logp, proxy)
    # negative tokens: row 1 (3); int(0.5 * 3) = 1 -> (1, 1), logp -2 < q: regularised
    d = q + 2.0
    k3 = math.exp(d) - d - 1
    want = [[-1.0, -1.0, -1.0], [1.0, 1.0 + k3, 1.0]]  # ratio 1: -A elsewhere
    assert out.loss_mat.tolist() == [pytest.approx(r) for r in want]
    assert out.extra["reg_frac"].item() == pytest.approx(1 / 6)
    assert out.extra["candidate_frac"].item() == pytest.approx(1 / 6)
    assert out.extra["reg_kl"].item() == pytest.approx(k3)
    out.loss_mat.sum().backward()
    # d/dlogp [-A r + (e^(q - logp) - (q - logp) - 1)] at r = 1: 1 - e^d + 1
    assert logp.grad[1, 1].item() == pytest.approx(1.0 - math.exp(d) + 1.0, rel=1e-5)
    assert logp.grad[1, 0].item() == pytest.approx(1.0)


def test_lp_reg_leaves_tokens_outside_the_proxy_or_above_it():
    logp = torch.tensor([[-1.0, -3.0, -0.2], [-0.5, -2.0, -1.0]], requires_grad=True)
    proxy = torch.tensor([[-0.1, -0.1, -0.1], [-0.3, float("-inf"), -1.5]])
    out = _loss(logp, proxy, bottom_frac=1.0)
    # all 3 negative tokens are candidates: (1, 0) -0.5 < -0.3 regularised; (1, 1) noise;
    # (1, 2) -1.0 > -1.5 already above its proxy
    d = -0.3 + 0.5
    assert out.loss_mat[1].tolist() == pytest.approx([1.0 + math.exp(d) - d - 1, 1.0, 1.0])
    assert out.extra["reg_frac"].item() == pytest.approx(1 / 6)
    assert out.extra["candidate_frac"].item() == pytest.approx(3 / 6)
    assert out.extra["proxy_support_frac"].item() == pytest.approx(5 / 6)
    out.loss_mat.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_lp_reg_uses_the_unclipped_ratio_on_regularised_tokens():
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    old = torch.tensor([[-1.0], [-1.0]])  # token (1, 0): ratio e^-1 < 0.8, clipped under PPO
    proxy = torch.tensor([[-0.1], [-1.0]])
    out = compute_policy_loss("lp_reg", logp, old, ADV, torch.ones(2, 1), proxy_logp=proxy,
                              clip_low=0.2, clip_high=0.2, dual_clip=None, bottom_frac=1.0, beta=0.0)
    assert out.loss_mat[1, 0].item() == pytest.approx(math.exp(-1.0))  # -A * r, not -A * 0.8
    plain = compute_policy_loss("vanilla", logp, old, ADV, torch.ones(2, 1),
                                clip_low=0.2, clip_high=0.2, dual_clip=None)
    assert plain.loss_mat[1, 0].item() == pytest.approx(0.8)


def test_a_loss_must_accept_its_token_stats():
    with pytest.raises(ValueError, match="must accept keyword"):
        @register_policy_loss("needs_stat_but_ignores_it", token_stats={"x": lambda: None})
        def _bad(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip):
            raise AssertionError
