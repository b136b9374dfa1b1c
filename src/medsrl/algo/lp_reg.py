"""Lp-Reg (arXiv 2510.03222), the policy loss ``lp_reg``: RL keeps pushing down the rare tokens of
failed responses (the "reasoning sparks" exploration needs); Lp-Reg pulls them towards
``pi_proxy``, the old policy renormalised over the tokens above ``tau`` (a scoring-forward stat)."""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor
from typing_extensions import Doc

from medsrl.algo.kl import kl_estimate
from medsrl.algo.logprobs import TokenReducer, _acc, _chunk_rows, masked_mean, per_token
from medsrl.algo.policy_loss import (
    PolicyLossOutput,
    _frac,
    clamped_log_ratio,
    clipped_surrogate,
    register_policy_loss,
)
from medsrl.settings import Flag, Fraction, NonNegative


def proxy_logprobs(logits: Tensor, labels: Tensor, tau: float, relative: bool = False) -> Tensor:
    """``log pi_proxy(label)`` ``[b, R]``: renormalised over the tokens of probability above ``tau``
    (``relative``: ``tau * max prob``, the authors' min-p form); ``-inf`` where the label is not."""
    parts = []
    rows = _chunk_rows(logits)
    for c, y in zip(logits.split(rows, dim=-2), labels.split(rows, dim=-1), strict=True):
        lp = torch.log_softmax(_acc(c), dim=-1)
        thresh = tau * lp.max(-1, keepdim=True).values.exp() if relative else tau
        keep = lp.exp() > thresh
        log_z = lp.masked_fill(~keep, float("-inf")).logsumexp(-1)
        picked = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        kept = keep.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        parts.append(torch.where(kept, picked - log_z, float("-inf")))
    return torch.cat(parts, dim=-1)


def lp_reg_proxy(tau: Annotated[Fraction, Doc("the proxy keeps tokens above this probability")] = 0.02,
                 tau_relative: Annotated[Flag, Doc("tau times the top probability (min-p) instead")] = False,
                 ) -> TokenReducer:
    """The scoring forward's reducer for ``lp_reg``'s ``proxy_logp``."""
    if not 0 < tau < 1:
        raise ValueError(f"tau must be in (0, 1), got {tau}")
    return lambda logits, labels: proxy_logprobs(logits, labels, tau, tau_relative)


def lowest_fraction(values: Tensor, eligible: Tensor, frac: float) -> Tensor:
    """Bool mask of the ``max(1, int(frac * n))`` smallest ``values`` among the ``n`` eligible
    positions (none when ``n`` is 0); ties go to the earlier position."""
    n = int(eligible.sum())
    out = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    if n:
        flat = values.flatten().masked_fill(~eligible.flatten(), float("inf"))
        out[torch.sort(flat, stable=True).indices[: max(1, int(frac * n))]] = True
    return out.view_as(values)


@register_policy_loss("lp_reg", token_stats={"proxy_logp": lp_reg_proxy})
def lp_reg_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    proxy_logp: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    bottom_frac: Annotated[Fraction, Doc("share of negative-advantage tokens (lowest log-prob) regularised")] = 0.01,
    beta: Annotated[NonNegative, Doc("the regulariser's coefficient")] = 1.0,
) -> PolicyLossOutput:
    """The clipped surrogate, except on the lowest ``bottom_frac`` of negative-advantage tokens by
    log-prob with ``logp < proxy_logp``: ``-A * ratio + beta * k3(logp, proxy_logp)``, unclipped."""
    if not 0 < bottom_frac <= 1 or beta < 0:
        raise ValueError(f"lp_reg needs 0 < bottom_frac <= 1 and beta >= 0, got {bottom_frac}, {beta}")
    base = clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                             dual_clip=dual_clip)
    adv = per_token(advantages, logp)
    with torch.no_grad():
        lp = logp.detach()
        low = lowest_fraction(lp, mask.bool() & (adv < 0).expand_as(lp), bottom_frac)
        reg = low & (lp < proxy_logp)
        target = torch.where(reg, proxy_logp, lp)  # finite wherever it is used
    kl = kl_estimate(logp, target, "k3")
    unclipped = -adv * torch.exp(clamped_log_ratio(logp, old_logp))
    base.loss_mat = torch.where(reg, unclipped + beta * kl, base.loss_mat)
    base.extra = {
        "reg_frac": _frac(reg, mask),
        "candidate_frac": _frac(low, mask),
        "reg_kl": masked_mean(kl.detach(), reg),
        "proxy_support_frac": _frac(torch.isfinite(proxy_logp), mask),
    }
    return base
