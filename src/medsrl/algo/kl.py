"""Per-token estimators of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch
from torch import Tensor

KL_ALIASES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(pi || ref) from tokens sampled from pi: ``k1`` unbiased, high variance; ``k2``
    biased, low variance; ``k3`` unbiased and >= 0, its log-ratio clamped to [-20, 20] and the
    estimate to [-10, 10] as verl's ``low_var_kl``, so one rare token cannot blow up."""
    k = KL_ALIASES.get(kind)
    if k is None:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {sorted(KL_ALIASES)}")
    if k == "k1":
        return logp - ref_logp
    if k == "k2":
        return 0.5 * (logp - ref_logp).square()
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def sampling_mismatch(engine_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's, over ``mask``: as verl's
    ``rollout_probs_diff``, a jump flags a broken weight sync or a precision problem."""
    m = mask.bool()
    if not m.any():
        return {}
    engine, trainer = engine_logp[m].double(), trainer_logp[m].double()  # gaps of ~1e-7: no fp32 cancellation
    diff = trainer - engine
    kl = kl_estimate(engine, trainer, "k3")  # KL(engine || trainer)
    prob_diff = (trainer.exp() - engine.exp()).abs()
    return {
        "logprob_diff_mean": float(diff.abs().mean()),
        "logprob_diff_max": float(diff.abs().max()),
        "prob_diff_mean": float(prob_diff.mean()),
        "kl_k3": float(kl.mean()),
    }
