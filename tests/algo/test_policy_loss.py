import math

import pytest
import torch

from medsrl.algo import (
    POLICY_LOSSES,
    PolicyLossOutput,
    clipped_surrogate,
    compute_policy_loss,
    register_policy_loss,
)
from medsrl.algo.policy_loss import POLICY_LOSS_OPTIONS, clip_settings
from medsrl.algo.settings import AlgorithmConfig


def _logp(ratios):
    # old_logp = 0, so ratio = exp(logp) exactly as given
    return torch.tensor(ratios).log().requires_grad_(True)


# clip_low = .2 -> lower bound .8 ; clip_high = .28 -> upper bound 1.28
RATIOS = [[0.5, 1.1, 1.25, 1.5],   # A = +1
          [0.5, 0.9, 0.75, 1.5]]   # A = -1
ADV = torch.tensor([1.0, -1.0])


def test_asymmetric_clip_values_and_fractions():
    logp = _logp(RATIOS)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])
    out = clipped_surrogate(logp, torch.zeros(2, 4), ADV, mask, clip_low=0.2, clip_high=0.28, dual_clip=None)
    # A=+1: loss = max(-r, -clip(r)): .5 -> -.5 (no clip for A>0 below), 1.1 -> -1.1,
    #       1.25 -> -1.25 (inside 1.28: would be clipped with a symmetric .2), 1.5 -> -1.28 (high)
    # A=-1: loss = max(r, clip(r)): .5 -> .8 (low), .9 -> .9, .75 -> .8 (low), 1.5 -> 1.5 (no clip
    #       for A<0 above)
    expected = torch.tensor([[-0.5, -1.1, -1.25, -1.28], [0.8, 0.9, 0.8, 1.5]])
    torch.testing.assert_close(out.loss_mat, expected)
    # masked tokens: 7; clipped: (0,3) high, (1,0) low; (1,2) is clipped but masked out
    torch.testing.assert_close(out.clipfrac, torch.tensor(2 / 7))
    torch.testing.assert_close(out.clipfrac_low, torch.tensor(1 / 7))
    torch.testing.assert_close(out.clipfrac_high, torch.tensor(1 / 7))
    torch.testing.assert_close(out.dual_clipfrac, torch.tensor(0.0))
    # approx_kl = mean(old - logp) = mean(-ln r) over the 7 masked tokens
    r = torch.tensor(RATIOS)
    kl = -(r.log() * mask).sum() / 7
    torch.testing.assert_close(out.approx_kl, kl)
    assert not out.clipfrac.requires_grad and not out.approx_kl.requires_grad


def test_symmetric_clip_clips_1_25():
    out = clipped_surrogate(_logp(RATIOS), torch.zeros(2, 4), ADV, torch.ones(2, 4),
                            clip_low=0.2, clip_high=0.2, dual_clip=None)
    # with clip_high = .2, ratio 1.25 with A>0 is clipped to 1.2
    assert out.loss_mat[0, 2].item() == pytest.approx(-1.2)
    torch.testing.assert_close(out.clipfrac_high, torch.tensor(2 / 8))


def test_clipped_tokens_have_zero_gradient():
    logp = _logp(RATIOS)
    out = clipped_surrogate(logp, torch.zeros(2, 4), ADV, torch.ones(2, 4),
                            clip_high=0.28, clip_low=0.2, dual_clip=None)
    out.loss_mat.sum().backward()
    # d(-A r)/d logp = -A r where unclipped, 0 where clipped
    expected = torch.tensor([[-0.5, -1.1, -1.25, 0.0], [0.0, 0.9, 0.0, 1.5]])
    torch.testing.assert_close(logp.grad, expected)


def test_dual_clip():
    # A = -1: ratio 4 -> max(4, 1.2) = 4 > 3 -> capped at 3 (dual clip); ratio 2.5 -> 2.5 (< 3)
    # A = +1: ratio 4 -> -1.2, dual clip never applies to A > 0
    logp = _logp([[4.0, 2.5], [4.0, 1.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    out = clipped_surrogate(logp, torch.zeros(2, 2), adv, torch.ones(2, 2), dual_clip=3.0, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(out.loss_mat, torch.tensor([[3.0, 2.5], [-1.2, -1.0]]))
    torch.testing.assert_close(out.dual_clipfrac, torch.tensor(1 / 4))
    out.loss_mat.sum().backward()
    # dual-clipped token and high-clipped token: zero gradient; ratio 2.5 with A=-1: grad 2.5
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.5], [0.0, -1.0]]))
    no_dual = clipped_surrogate(logp, torch.zeros(2, 2), adv, torch.ones(2, 2),
                                clip_low=0.2, clip_high=0.2, dual_clip=None)
    assert no_dual.loss_mat[0, 0].item() == pytest.approx(4.0)
    with pytest.raises(ValueError):
        clipped_surrogate(logp, torch.zeros(2, 2), adv, torch.ones(2, 2), dual_clip=1.0, clip_low=0.2, clip_high=0.2)


def test_broadcast_advantages_equal_expanded():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 5, generator=g) * 0.3, torch.randn(3, 5, generator=g) * 0.3
    adv = torch.randn(3, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    a = clipped_surrogate(logp, old, adv, mask, clip_high=0.28, dual_clip=3.0, clip_low=0.2)
    b = clipped_surrogate(logp, old, adv[:, None].expand(3, 5), mask, clip_high=0.28, dual_clip=3.0, clip_low=0.2)
    fields = ("loss_mat", "clipfrac", "clipfrac_low", "clipfrac_high", "dual_clipfrac", "approx_kl")
    for f in fields:
        torch.testing.assert_close(getattr(a, f), getattr(b, f))
    assert a.clipfrac > 0  # the comparison covers clipped tokens too
    torch.testing.assert_close(a.clipfrac, a.clipfrac_low + a.clipfrac_high)


def test_log_ratio_clamped_before_exp():
    # log-ratio 100 would overflow fp32 (e^100 = inf); it is clamped to 20 before exp
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    out = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2),
                            clip_low=0.2, clip_high=0.2, dual_clip=None)
    assert torch.isfinite(out.loss_mat).all()
    assert out.loss_mat[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    out.loss_mat.sum().backward()
    assert torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------- registry

CLIPS = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
FIELDS = ("loss_mat", "clipfrac", "clipfrac_low", "clipfrac_high", "dual_clipfrac", "approx_kl")


@pytest.fixture
def restore_losses():
    saved = dict(POLICY_LOSSES), dict(POLICY_LOSS_OPTIONS)
    yield
    for registry, before in zip((POLICY_LOSSES, POLICY_LOSS_OPTIONS), saved, strict=True):
        registry.clear()
        registry.update(before)


def test_vanilla_equals_clipped_surrogate():
    assert POLICY_LOSSES["vanilla"] is clipped_surrogate
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])
    for adv in (ADV, ADV[:, None].expand(2, 4)):  # [B] and [B,T]
        a = compute_policy_loss("vanilla", _logp(RATIOS), torch.zeros(2, 4), adv, mask, **CLIPS)
        b = clipped_surrogate(_logp(RATIOS), torch.zeros(2, 4), adv, mask, **CLIPS)
        for f in FIELDS:
            torch.testing.assert_close(getattr(a, f), getattr(b, f))
    # hand value: A=+1, ratio 1.5 -> clipped at 1.28 (clip_high .28) -> -1.28
    assert a.loss_mat[0, 3].item() == pytest.approx(-1.28)


def test_unknown_loss_lists_valid_names_sorted(restore_losses):
    @register_policy_loss("another")
    def another(logp, old_logp, advantages, mask, **clips):
        return clipped_surrogate(logp, old_logp, advantages, mask, **clips)

    with pytest.raises(ValueError, match="'gspo'") as e:
        compute_policy_loss("gspo", _logp(RATIOS), torch.zeros(2, 4), ADV, torch.ones(2, 4))
    assert "another, clip_cov, kl_cov, lp_reg, vanilla" in str(e.value)


def test_bad_option_names_loss_and_config_key():
    """Checked at start, against the options the loss registered, not at its first call."""
    with pytest.raises(ValueError, match=r"algorithm.policy_loss_options.clip_ratio_c is not a setting of "
                                         r"policy_loss 'vanilla' \(known: \)"):
        AlgorithmConfig(policy_loss="vanilla", policy_loss_options={"clip_ratio_c": 3.0})
    with pytest.raises(ValueError, match="algorithm.policy_loss_options.tau must be a number in"):
        AlgorithmConfig(policy_loss="lp_reg", policy_loss_options={"tau": 0})
    assert AlgorithmConfig(policy_loss="lp_reg", policy_loss_options={"tau": 0.1}).policy_loss_options == {"tau": 0.1}


def test_registered_loss_gets_clips_and_extra_options(restore_losses):
    seen = {}

    @register_policy_loss("scaled")
    def scaled(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, scale=1.0):
        seen.update(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, scale=scale)
        out = clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low,
                                clip_high=clip_high, dual_clip=dual_clip)
        out.loss_mat = out.loss_mat * scale
        return out

    out = compute_policy_loss("scaled", _logp(RATIOS), torch.zeros(2, 4), ADV, torch.ones(2, 4),
                              **CLIPS, scale=2.0)
    assert isinstance(out, PolicyLossOutput)
    assert seen == {**CLIPS, "scale": 2.0}
    # A=+1, ratio .5: -.5 unclipped, times 2 -> -1
    assert out.loss_mat[0, 0].item() == pytest.approx(-1.0)


def test_type_error_inside_loss_is_not_blamed_on_options(restore_losses):
    @register_policy_loss("broken")
    def broken(logp, old_logp, advantages, mask, **clips):
        return logp + "x"  # TypeError from the loss's own code

    with pytest.raises(TypeError):
        compute_policy_loss("broken", _logp(RATIOS), torch.zeros(2, 4), ADV, torch.ones(2, 4),
                            **CLIPS)


def test_duplicate_refused_and_a_loss_gets_only_the_clip_settings_it_names(restore_losses):
    with pytest.raises(ValueError, match="vanilla"):
        register_policy_loss("vanilla")(clipped_surrogate)
    assert POLICY_LOSSES["vanilla"] is clipped_surrogate

    @register_policy_loss("no_dual")
    def no_dual(logp, old_logp, advantages, mask, *, clip_low, clip_high):
        raise AssertionError("never called")

    algo = AlgorithmConfig(clip_low=0.1, clip_high=0.3)
    assert clip_settings("no_dual", algo) == {"clip_low": 0.1, "clip_high": 0.3}
    assert clip_settings("vanilla", algo) == {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 10.0}
    assert clip_settings("kl_cov", algo) == {}  # it does not clip
    assert list(POLICY_LOSS_OPTIONS["no_dual"].model_fields) == []  # clip settings are algorithm's
