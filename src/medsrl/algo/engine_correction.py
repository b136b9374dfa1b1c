"""Truncated importance sampling (TIS) against the rollout engine's own sampling distribution:
vLLM in bf16 samples a little off the trainer's, so each token's policy-gradient term is weighted
by a detached ``min(pi_old / pi_engine, cap)`` (verl's ``tis_imp_ratio_cap``, TRL's
``vllm_importance_sampling_cap``); the KL and entropy terms stay unweighted.
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_is_weights(old_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """Per-token ``min(exp(old_logp - engine_logp), cap)``, detached, in fp32 or wider."""
    if cap <= 0:
        raise ValueError(f"truncated importance sampling: cap must be > 0, got {cap}")
    ratio = (old_logp.detach().double() - engine_logp.detach().double()).exp()
    return ratio.clamp(max=cap).to(torch.promote_types(old_logp.dtype, torch.float32))


def truncated_is_stats(weights: Tensor, mask: Tensor, cap: float) -> dict[str, float]:
    """Token means over ``mask``: the weight, and the share of tokens held at the cap."""
    m = mask.bool()
    if not m.any():
        return {}
    w = weights[m].double()
    return {"weight_mean": float(w.mean()), "capped_frac": float((w >= cap).double().mean())}


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
