"""Importance correction against the rollout engine's own sampling distribution: vLLM in bf16
samples a little off the trainer's, so each sampled token's policy-gradient term is weighted by a
detached weight built from ``pi_old / pi_engine`` (the KL and entropy terms stay unweighted).

``algorithm.engine_is_cap`` (``C``) turns it on; ``algorithm.engine_is_mode`` picks one of TRL's four
weights (``vllm_importance_sampling_mode``), with ``d_t = log pi_old(y_t) - log pi_engine(y_t)``
over the response's tokens: ``token_truncate`` (verl's ``rollout_is="token"``) ``min(exp(d_t), C)``;
``token_mask`` ``exp(d_t)``, 0 above ``C``; ``sequence_truncate`` / ``sequence_mask`` the same on
``rho = exp(sum_t d_t)`` (a sum, as TRL and verl), on every token of the response. No lower bound
(TRL's default); a ratio equal to ``C`` is kept. ``sum_t d_t`` drifts below 0 and spreads with the
length, so the sequence modes shrink or mask long responses more than short ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def truncated_is_weights(old_logp: Tensor, engine_logp: Tensor, cap: float, mask: Tensor | None = None) -> Tensor:
    """``token_truncate``'s weights, 1 where ``mask`` is 0 (padding); ``engine_logp``: whatever
    sampled the tokens (the engine, or R3's stored behaviour policy)."""
    w = engine_is_weights(old_logp, engine_logp, mask, cap)
    return w if mask is None else torch.where(mask.bool(), w, torch.ones_like(w))


def token_log_ratios(old_logp: Tensor, engine_logp: Tensor, mask: Tensor | None) -> Tensor:
    """``[b, R]`` in fp64 (``mask`` unused: the loss masks the padding)."""
    return old_logp.detach().double() - engine_logp.detach().double()


def sequence_log_ratios(old_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Tensor:
    """``[b, 1]`` sums over ``mask`` in fp64: padding (even non-finite) adds nothing."""
    diff = token_log_ratios(old_logp, engine_logp, mask)
    return torch.where(mask.bool(), diff, torch.zeros_like(diff)).sum(dim=-1, keepdim=True)


def truncate(ratio: Tensor, cap: float) -> Tensor:
    return ratio.clamp(max=cap)


def mask_above(ratio: Tensor, cap: float) -> Tensor:
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


def engine_is_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor | None, cap: float,
                      mode: str = "token_truncate") -> Tensor:
    """``[b, R]`` detached weights of ``mode`` in fp32 or wider, a sequence's broadcast over its
    columns (padding included: the loss masks them)."""
    if cap <= 0:
        raise ValueError(f"truncated importance sampling: cap must be > 0, got {cap}")
    log_ratio, bound = _mode(mode)
    weights = bound(log_ratio(old_logp, engine_logp, mask).exp(), cap)
    return weights.expand(old_logp.shape).to(torch.promote_types(old_logp.dtype, torch.float32)).contiguous()


def engine_is_stats(weights: Tensor, mask: Tensor, cap: float, mode: str = "token_truncate") -> dict[str, float]:
    """Token means over ``mask`` (shares of the loss's token terms, whatever the micro-batch cut):
    ``weight_mean``, and the share of tokens at the cap (``capped_frac``) or at 0 (``masked_frac``)."""
    _, bound = _mode(mode)
    m = mask.bool()
    if not m.any():
        return {}
    w = weights[m].double()
    if bound is truncate:
        return {"weight_mean": float(w.mean()), "capped_frac": float((w >= cap).double().mean())}
    return {"weight_mean": float(w.mean()), "masked_frac": float((w == 0).double().mean())}


def check_engine_correction(cap: float | None, logprobs: bool, temperature: float, top_p: float) -> None:
    """Truncated IS divides the trainer's probability (temperature 1, whole vocabulary) by the
    engine's sampling one: it needs the engine's log-probs, and plain sampling."""
    if cap is None:
        return
    if not logprobs:
        raise ValueError("algorithm.engine_is_cap needs the engine's log-probs: set rollout.logprobs=true")
    if temperature != 1.0 or top_p != 1.0:
        raise ValueError(
            f"algorithm.engine_is_cap with rollout.temperature={temperature}, top_p={top_p}: the weight "
            "would correct for the temperature / top-p, not the engine; use 1.0 and 1.0 or "
            "algorithm.engine_is_cap=null")
