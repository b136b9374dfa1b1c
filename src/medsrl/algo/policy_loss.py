"""PPO clipped surrogate with asymmetric clip ranges (DAPO clip-higher) and dual-clip."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from medsrl.algo.logprobs import masked_mean


@dataclass
class PolicyLossOutput:
    """Per-token loss plus detached scalar diagnostics (fractions are over masked tokens).

    - ``loss_mat`` [B,T]: per-token loss, unmasked values (the caller aggregates).
    - ``clipfrac``: tokens where the clipped branch was chosen, i.e. the PPO ``max`` picked
      ``-A * clip(ratio)`` strictly over ``-A * ratio``; equals ``clipfrac_low + clipfrac_high``.
    - ``clipfrac_low``: ``A < 0`` and ``ratio < 1 - clip_low`` (low bound active).
    - ``clipfrac_high``: ``A > 0`` and ``ratio > 1 + clip_high`` (high bound active).
    - ``dual_clipfrac``: ``A < 0`` and the dual-clip cap ``-A * dual_clip`` is active
      (``ratio > dual_clip``); 0 without dual-clip.
    - ``approx_kl``: masked mean of ``old_logp - logp`` (k1 estimate of KL(old || new)).
    """

    loss_mat: Tensor
    clipfrac: Tensor
    clipfrac_low: Tensor
    clipfrac_high: Tensor
    dual_clipfrac: Tensor
    approx_kl: Tensor


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """Per-token PPO loss ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``.

    ``r = exp(logp - old_logp)`` with the log-ratio clamped to [-20, 20] so ``exp`` stays finite.
    A larger ``clip_high`` (DAPO clip-higher) lets low-probability tokens grow, against entropy
    collapse. ``dual_clip`` (> 1) caps the loss of ``A < 0`` tokens at ``-A * dual_clip``, so a
    huge ratio on a bad token cannot dominate the update. ``advantages`` is [B] (broadcast over
    tokens) or [B,T]. Clipped tokens get zero gradient.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    with torch.no_grad():
        clipped = loss_clipped > loss_unclipped
        low = (adv < 0) & (ratio < 1.0 - clip_low)
        high = (adv > 0) & (ratio > 1.0 + clip_high)
        dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (loss > cap).detach()
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return PolicyLossOutput(
        loss_mat=loss,
        clipfrac=_frac(clipped, mask),
        clipfrac_low=_frac(low, mask),
        clipfrac_high=_frac(high, mask),
        dual_clipfrac=_frac(dual, mask),
        approx_kl=masked_mean((old_logp - logp).detach(), mask),
    )


def _frac(flags: Tensor, mask: Tensor) -> Tensor:
    """Fraction of masked tokens where ``flags`` is set (flags may broadcast to the mask)."""
    return masked_mean(flags.expand_as(mask).float(), mask)
