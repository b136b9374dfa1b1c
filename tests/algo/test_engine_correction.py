import math

import pytest
import torch
from pydantic import ValidationError

from medsrl.algo import aggregate_loss, compute_policy_loss
from medsrl.algo.engine_correction import (
    ENGINE_IS_MODES,
    engine_is_stats,
    engine_is_weights,
    truncated_is_weights,
)
from medsrl.algo.settings import AlgorithmConfig


def test_weights_are_the_capped_ratio_of_trainer_to_engine_probabilities():
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    engine = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)]])
    w = truncated_is_weights(old, engine, cap=2.0)
    # 0.5/0.25 = 2 (at the cap), 0.2/0.4 = 0.5, 0.9/0.1 = 9 -> 2
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 2.0], rel=1e-6)
    assert w.dtype == torch.float32 and not w.requires_grad
    stats = engine_is_stats(w, torch.tensor([[1.0, 1.0, 0.0]]), 2.0)
    assert stats == pytest.approx({"weight_mean": 1.25, "capped_frac": 0.5})
    assert engine_is_stats(w, torch.zeros(1, 3), 2.0) == {}


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


# ------------------------------------------------------------------ algorithm.engine_is_mode

# three responses, cap 2 (log 2 = 0.693); d = log pi_old - log pi_engine per column, the
# padding's (5.0, 3.0) far over the cap so that counting them anywhere would show
CAP = 2.0
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                     [1.0, 1.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0]])
DIFF = [[0.1, 0.2, -0.1, 5.0],  # response sum 0.2 -> exp(0.2) = 1.2214 (under the cap)
        [0.5, 0.8, 3.0, 3.0],  # sum 1.3 -> exp(1.3) = 3.6693 (over); its token 0.8 -> 2.2255 (over)
        [-0.3, -0.4, -0.2, -0.1]]  # sum -1.0 -> exp(-1) = 0.3679 (no lower bound)
ENGINE = torch.full((3, 4), -2.0)
OLD = ENGINE + torch.tensor(DIFF)
e = math.exp


def _want(mode: str) -> list[list[float]]:
    """The weights written out by hand (padding columns: their own token ratio in token modes, the
    response's weight in sequence modes)."""
    return {
        "token_truncate": [[e(0.1), e(0.2), e(-0.1), 2.0],
                           [e(0.5), 2.0, 2.0, 2.0],
                           [e(-0.3), e(-0.4), e(-0.2), e(-0.1)]],
        "token_mask": [[e(0.1), e(0.2), e(-0.1), 0.0],
                       [e(0.5), 0.0, 0.0, 0.0],
                       [e(-0.3), e(-0.4), e(-0.2), e(-0.1)]],
        "sequence_truncate": [[e(0.2)] * 4, [2.0] * 4, [e(-1.0)] * 4],
        "sequence_mask": [[e(0.2)] * 4, [0.0] * 4, [e(-1.0)] * 4],
    }[mode]


@pytest.mark.parametrize("mode", list(ENGINE_IS_MODES))
def test_each_mode_gives_the_hand_computed_weights_with_padding(mode):
    w = engine_is_weights(OLD, ENGINE, MASK, CAP, mode)
    assert w.shape == (3, 4) and w.dtype == torch.float32 and not w.requires_grad
    for got, want in zip(w.tolist(), _want(mode), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("mode", list(ENGINE_IS_MODES))
def test_stats_are_token_shares_over_the_mask(mode):
    """9 response tokens (3 + 2 + 4); a sequence's weight counts once per token."""
    w = engine_is_weights(OLD, ENGINE, MASK, CAP, mode)
    want = {
        "token_truncate": {"weight_mean": (e(0.1) + e(0.2) + e(-0.1) + e(0.5) + 2.0
                                           + e(-0.3) + e(-0.4) + e(-0.2) + e(-0.1)) / 9,
                           "capped_frac": 1 / 9},
        "token_mask": {"weight_mean": (e(0.1) + e(0.2) + e(-0.1) + e(0.5)
                                       + e(-0.3) + e(-0.4) + e(-0.2) + e(-0.1)) / 9,
                       "masked_frac": 1 / 9},
        "sequence_truncate": {"weight_mean": (3 * e(0.2) + 2 * 2.0 + 4 * e(-1.0)) / 9, "capped_frac": 2 / 9},
        "sequence_mask": {"weight_mean": (3 * e(0.2) + 4 * e(-1.0)) / 9, "masked_frac": 2 / 9},
    }[mode]
    assert engine_is_stats(w, MASK, CAP, mode) == pytest.approx(want, rel=1e-6)
    assert engine_is_stats(w, torch.zeros(3, 4), CAP, mode) == {}


def test_the_default_mode_is_todays_token_truncation_exactly():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 7, generator=g, requires_grad=True)
    engine = old.detach() + 0.5 * torch.randn(4, 7, generator=g)
    mask = (torch.arange(7) < torch.tensor([[7], [5], [1], [0]])).float()
    w = engine_is_weights(old, engine, mask, 1.5)
    assert torch.equal(w, truncated_is_weights(old, engine, 1.5)) and not w.requires_grad
    assert set(engine_is_stats(w, mask, 1.5)) == {"weight_mean", "capped_frac"}
    assert AlgorithmConfig().engine_is_mode == "token_truncate"


def test_a_mask_mode_zeroes_the_whole_sequence_over_the_cap():
    """Row 1's response ratio exp(1.3) > 2: every column 0 in sequence_mask, though its first
    token alone (exp(0.5)) is under the cap and keeps its ratio in token_mask."""
    seq = engine_is_weights(OLD, ENGINE, MASK, CAP, "sequence_mask")
    tok = engine_is_weights(OLD, ENGINE, MASK, CAP, "token_mask")
    assert seq[1].tolist() == [0.0] * 4
    assert tok[1, 0].item() == pytest.approx(e(0.5), rel=1e-6) and tok[1, 1].item() == 0.0
    # a ratio exactly at the cap is kept (TRL and verl mask only what is above it)
    at_cap = torch.tensor([[math.log(2.0)]], dtype=torch.float64)
    same_logp = torch.zeros(1, 1, dtype=torch.float64)
    for mode in ("token_mask", "sequence_mask"):
        assert engine_is_weights(at_cap, same_logp, torch.ones(1, 1), 2.0, mode).item() == 2.0


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_padding_never_enters_the_sequence_sum(mode):
    """Whatever the padding columns hold (even inf / nan), a response's weight is its tokens'."""
    want = engine_is_weights(OLD, ENGINE, MASK, CAP, mode)
    junk = OLD.clone()
    junk[0, 3], junk[1, 2], junk[1, 3] = float("inf"), float("nan"), -1e30
    assert torch.equal(engine_is_weights(junk, ENGINE, MASK, CAP, mode), want)
    # without its mask, row 0 would sum 5.2 and be capped / masked
    unmasked = engine_is_weights(OLD, ENGINE, torch.ones(3, 4), CAP, mode)
    assert unmasked[0, 0].item() in (2.0, 0.0) and want[0, 0].item() == pytest.approx(e(0.2), rel=1e-6)


def test_weights_are_fp32_or_wider_and_long_responses_do_not_overflow():
    old = torch.zeros(2, 3, dtype=torch.bfloat16)
    engine = torch.tensor([[-400.0, -400.0, -400.0], [400.0, 400.0, 400.0]], dtype=torch.bfloat16)
    mask = torch.ones(2, 3)
    w = engine_is_weights(old, engine, mask, CAP, "sequence_truncate")  # exp(+-1200): inf / 0 in fp64
    assert w.dtype == torch.float32 and w.tolist() == [[2.0] * 3, [0.0] * 3]
    assert engine_is_weights(old, engine, mask, CAP, "sequence_mask").tolist() == [[0.0] * 3, [0.0] * 3]
    assert engine_is_weights(old.double(), engine.double(), mask, CAP, "token_mask").dtype == torch.float64


def test_the_mode_names_are_the_registrys_and_the_config_checks_them():
    assert list(ENGINE_IS_MODES) == ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
    for mode in ENGINE_IS_MODES:
        assert AlgorithmConfig(engine_is_mode=mode).engine_is_mode == mode
    with pytest.raises(ValidationError, match="sequence_mask"):
        AlgorithmConfig(engine_is_mode="sequence")
    with pytest.raises(ValueError, match="engine_is_mode='geometric'"):
        engine_is_weights(OLD, ENGINE, MASK, CAP, "geometric")
    with pytest.raises(ValueError, match="cap must be > 0"):
        engine_is_weights(OLD, ENGINE, MASK, 0.0, "sequence_mask")
