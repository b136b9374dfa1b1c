"""Importance correction against the rollout engine's own sampling distribution: vLLM in bf16
samples a little off the trainer's, so each sampled token's policy-gradient term is weighted by a
detached weight built from ``pi_old / pi_engine``; the KL and entropy terms stay unweighted.

``algorithm.engine_is_cap`` (``C``) turns it on and bounds it; ``algorithm.engine_is_mode`` picks
one of four weights (``ENGINE_IS_MODES``), the four of TRL's ``GRPOTrainer``
(``vllm_importance_sampling_mode``, trl/trainer/grpo_trainer.py and grpo_config.py). With
``d_t = log pi_old(y_t) - log pi_engine(y_t)`` over the response's tokens (padding never enters):

- ``token_truncate`` (ours by default; verl's ``rollout_is="token"`` with ``rollout_is_threshold``,
  verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_correction_weights``):
  ``w_t = min(exp(d_t), C)``.
- ``token_mask``: ``w_t = exp(d_t)`` if ``exp(d_t) <= C``, else 0.
- ``sequence_truncate`` (verl's ``rollout_is="sequence"``): ``rho = exp(sum_t d_t)``, the ratio
  of the whole response's probabilities (a sum, not the geometric mean's ``mean_t d_t``: TRL and
  verl both sum), and ``w_t = min(rho, C)`` on every token of the response.
- ``sequence_mask`` (TRL's default mode, with ``vllm_importance_sampling_clip_max`` 3):
  ``w_t = rho`` if ``rho <= C``, else 0 on every token of the response.

No lower bound, as TRL's default (``vllm_importance_sampling_clip_min=None``); verl's older
mask mode (``rollout_is_level`` / ``rollout_is_mode="mask"``, verl/trainer/ppo/mismatch_helper.py,
since replaced by rejection sampling, ``rollout_rs``) also zeroed ratios below ``1 / C``. A ratio
equal to ``C`` is kept. Over a long response ``sum_t d_t`` drifts below 0 (its mean is
``-KL(engine || trainer)`` per token) and spreads like the square root of the length, so at the
same per-token mismatch the sequence modes shrink or mask long responses more than short ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _check_cap(cap: float) -> None:
    if cap <= 0:
        raise ValueError(f"truncated importance sampling: cap must be > 0, got {cap}")


def _out_dtype(old_logp: Tensor) -> torch.dtype:
    return torch.promote_types(old_logp.dtype, torch.float32)


def truncated_is_weights(old_logp: Tensor, engine_logp: Tensor, cap: float, mask: Tensor | None = None) -> Tensor:
    """Per-token ``min(exp(old_logp - engine_logp), cap)``, detached, in fp32 or wider; 1 where
    ``mask`` is 0 (padding). ``engine_logp``: the log-probs of whatever sampled the tokens (the
    engine, or R3's stored behaviour policy)."""
    _check_cap(cap)
    ratio = (old_logp.detach().double() - engine_logp.detach().double()).exp()
    w = ratio.clamp(max=cap).to(_out_dtype(old_logp))
    return w if mask is None else torch.where(mask.bool(), w, torch.ones_like(w))


def token_log_ratios(old_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Tensor:
    """``[b, R]`` per-token ``log pi_old - log pi_engine`` in fp64, detached (``mask`` unused: a
    token's ratio is its own; the loss masks the padding)."""
    del mask
    return old_logp.detach().double() - engine_logp.detach().double()


def sequence_log_ratios(old_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Tensor:
    """``[b, 1]`` the response's ``sum_t (log pi_old - log pi_engine)`` over ``mask``, in fp64,
    detached; padding (whatever its log-probs hold, even non-finite) adds nothing."""
    diff = old_logp.detach().double() - engine_logp.detach().double()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff)).sum(dim=-1, keepdim=True)


def truncate(ratio: Tensor, cap: float) -> Tensor:
    """``min(ratio, cap)``."""
    return ratio.clamp(max=cap)


def mask_above(ratio: Tensor, cap: float) -> Tensor:
    """``ratio`` where ``ratio <= cap``, else 0."""
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


# name -> (the log-ratio's level: [b, R] per token or [b, 1] per sequence, what the bound does)
ENGINE_IS_MODES: dict[str, tuple[Callable[[Tensor, Tensor, Tensor], Tensor], Callable[[Tensor, float], Tensor]]] = {
    "token_truncate": (token_log_ratios, truncate),
    "token_mask": (token_log_ratios, mask_above),
    "sequence_truncate": (sequence_log_ratios, truncate),
    "sequence_mask": (sequence_log_ratios, mask_above),
}


def _mode(mode: str):
    try:
        return ENGINE_IS_MODES[mode]
    except KeyError:
        raise ValueError(f"algorithm.engine_is_mode={mode!r}: expected one of {list(ENGINE_IS_MODES)}") from None


def engine_is_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, cap: float,
                      mode: str = "token_truncate") -> Tensor:
    """``[b, R]`` detached weights of ``mode`` (``ENGINE_IS_MODES``) in fp32 or wider: per token,
    or one per response broadcast over its ``R`` columns (padding columns included; the loss masks
    them). ``token_truncate`` is ``truncated_is_weights`` exactly."""
    _check_cap(cap)
    log_ratio, bound = _mode(mode)
    weights = bound(log_ratio(old_logp, engine_logp, mask).exp(), cap)
    return weights.expand(old_logp.shape).to(_out_dtype(old_logp)).contiguous()


def engine_is_stats(weights: Tensor, mask: Tensor, cap: float, mode: str = "token_truncate") -> dict[str, float]:
    """Token means over ``mask``, in every mode (a sequence's weight counts once per token, so the
    numbers are shares of the loss's token terms and do not depend on the micro-batch cut):
    ``weight_mean``; truncate modes: ``capped_frac``, the share of tokens held at the cap; mask
    modes: ``masked_frac``, the share of tokens whose weight is 0."""
    _, bound = _mode(mode)
    m = mask.bool()
    if not m.any():
        return {}
    w = weights[m].double()
    if bound is truncate:
        return {"weight_mean": float(w.mean()), "capped_frac": float((w >= cap).double().mean())}
    return {"weight_mean": float(w.mean()), "masked_frac": float((w == 0).double().mean())}


def check_engine_correction(cap: float | None, logprobs: bool, temperature: float, top_p: float) -> None:
    """The settings truncated IS needs: it divides the trainer's probability (temperature 1, the
    whole vocabulary) by the engine's sampling one, so it needs the engine's log-probs and
    measures the engine's numerics only when sampling is plain."""
    if cap is None:
        return
    if not logprobs:
        raise ValueError("algorithm.engine_is_cap needs the engine's log-probs: set rollout.logprobs=true")
    if temperature != 1.0 or top_p != 1.0:
        raise ValueError(
            f"algorithm.engine_is_cap with rollout.temperature={temperature}, top_p={top_p}: the weight "
            "would correct for the temperature / top-p, not the engine; use 1.0 and 1.0 or "
            "algorithm.engine_is_cap=null")
