"""STEER's per-token loss weight (arXiv 2510.10150): damp the tokens whose update would move the
policy's entropy most.

``Omega = |A / pi_old * pi (1 - pi) (log pi + H)|`` per token; at the start of the update
``pi = pi_old``, so ``Omega = |A (1 - pi) (log pi + H)|`` from the old policy's token
probability and entropy. Omega is mapped linearly over the batch's response tokens to
``[low, high]``, the largest Omega getting ``low``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from medsrl.algo.logprobs import per_token


def steer_omega(advantages: Tensor, old_logp: Tensor, entropy: Tensor) -> Tensor:
    """``|A (1 - pi) (log pi + H)|`` per token ``[B, T]`` (``A`` may be ``[B]``)."""
    adv = per_token(advantages, old_logp)
    lp = old_logp.detach().float()
    return (adv.detach().float() * (1 - lp.exp()) * (lp + entropy.detach().float())).abs()


def steer_weights(omega: Tensor, mask: Tensor, low: float = 0.8, high: float = 1.2,
                  bounds: tuple[float, float] | None = None) -> Tensor:
    """``high - (high - low) * (omega - min) / (max - min)`` on the masked tokens, 1 elsewhere.

    ``bounds`` gives ``(min, max)`` when they come from elsewhere (every rank's tokens); without
    spread (``max == min``) every weight is 1.
    """
    if not low <= high:
        raise ValueError(f"steer weights need low <= high, got {low}, {high}")
    m = mask.bool()
    if bounds is None:
        bounds = (float(omega[m].min()), float(omega[m].max())) if m.any() else (0.0, 0.0)
    lo, hi = bounds
    if hi <= lo:
        return torch.ones_like(omega)
    w = high - (high - low) * (omega - lo) / (hi - lo)
    return torch.where(m, w, torch.ones_like(w))
