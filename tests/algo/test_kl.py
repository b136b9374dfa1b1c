import math

import pytest
import torch

from medsrl.algo import kl_estimate

LN2 = math.log(2.0)


def test_hand_computed_values():
    # d = logp - ref = [ln2, -ln2, 0]
    logp = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.3)])
    ref = torch.tensor([math.log(0.25), math.log(0.5), math.log(0.3)])
    # k1 = d
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([LN2, -LN2, 0.0]))
    # k2 = .5 d^2 = .5 * .48045 = .24023
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"),
                               torch.tensor([0.5 * LN2**2, 0.5 * LN2**2, 0.0]))
    # k3 = e^{-d} + d - 1: [.5 + .6931 - 1 = .1931, 2 - .6931 - 1 = .3069, 0]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"),
                               torch.tensor([LN2 - 0.5, 1.0 - LN2, 0.0]))
    torch.testing.assert_close(kl_estimate(logp, ref), kl_estimate(logp, ref, "k3"))


def test_aliases_and_unknown():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, generator=g), torch.randn(5, generator=g)
    for alias, k in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        torch.testing.assert_close(kl_estimate(a, b, alias), kl_estimate(a, b, k))
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(a, b, "full")


def test_k3_nonnegative_and_clamped():
    g = torch.Generator().manual_seed(1)
    logp, ref = 5 * torch.randn(1000, generator=g), 5 * torch.randn(1000, generator=g)
    k3 = kl_estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    # ref - logp = 100 -> clamped log-ratio 20 -> e^20 - 21 -> clamped to 10 (finite)
    assert kl_estimate(torch.tensor([-100.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_k1_k3_unbiased_for_kl_pi_ref():
    # Sample tokens from pi; E_pi[k1] and E_pi[k3] equal KL(pi || ref) (not KL(ref || pi)).
    pi = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl_true = (pi * (pi / ref).log()).sum()  # 0.4986
    kl_reverse = (ref * (ref / pi).log()).sum()  # 0.5838, must not be what we estimate
    assert abs(kl_true - kl_reverse) > 0.05
    gen = torch.Generator().manual_seed(0)
    idx = torch.multinomial(pi, 400_000, replacement=True, generator=gen)
    for kind in ("k1", "k3"):
        est = kl_estimate(pi.log()[idx], ref.log()[idx], kind).mean()
        assert abs(est - kl_true) < 0.01, kind


def test_sampling_mismatch_hand_checked():
    from medsrl.algo.kl import sampling_mismatch

    engine = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.0, -1.5, 3.0], [-0.7, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # padding is ignored
    got = sampling_mismatch(engine, trainer, mask)
    assert got["logprob_diff_mean"] == pytest.approx((0.0 + 0.5 + 0.2) / 3)
    assert got["logprob_diff_max"] == pytest.approx(0.5)
    k3 = [0.0, math.exp(0.5) - 0.5 - 1, math.exp(-0.2) + 0.2 - 1]
    assert got["kl_k3"] == pytest.approx(sum(k3) / 3)
    pd = [0.0, abs(math.exp(-1.5) - math.exp(-2.0)), abs(math.exp(-0.7) - math.exp(-0.5))]
    assert got["prob_diff_mean"] == pytest.approx(sum(pd) / 3)
    assert sampling_mismatch(engine, engine, mask)["kl_k3"] == 0.0
    assert sampling_mismatch(engine, trainer, torch.zeros_like(mask)) == {}


def test_sampling_mismatch_is_not_negative_for_tiny_gaps():
    """k3 of log-ratios near 1e-7 cancels to negative values in float32; the diagnostic is >= 0."""
    from medsrl.algo.kl import sampling_mismatch

    gen = torch.Generator().manual_seed(0)
    engine = -torch.rand(64, 32, generator=gen) * 5
    trainer = engine + torch.randn(64, 32, generator=gen) * 3e-7
    got = sampling_mismatch(engine, trainer, torch.ones(64, 32))
    assert got["kl_k3"] >= 0.0
    assert got["kl_k3"] < 1e-12
