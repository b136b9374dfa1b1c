"""Entropy-covariance policy losses ``clip_cov`` and ``kl_cov`` ("The Entropy Mechanism of RL for
Reasoning Language Models", verl's names and defaults): entropy falls fastest through the tokens
whose log-prob and advantage covary most, so both act on a small share of those."""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor
from typing_extensions import Doc

from medsrl.algo.logprobs import masked_mean, per_token
from medsrl.algo.lp_reg import lowest_fraction
from medsrl.algo.policy_loss import (
    PolicyLossOutput,
    _frac,
    clamped_log_ratio,
    clipped_surrogate,
    register_policy_loss,
)
from medsrl.settings import Count, Fraction, NonNegative, Number


def token_covariance(advantages: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """``(A - mean A) * (logp - mean logp)`` per token, means over the mask; detached: it selects tokens."""
    adv = per_token(advantages, logp).detach().expand_as(logp).float()
    lp = logp.detach().float()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def clip_cov_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    clip_cov_ratio: Annotated[Fraction, Doc("share of tokens whose gradient is cut")] = 0.0002,
    clip_cov_lb: Annotated[Number, Doc("lower bound of the covariance of a candidate token")] = 1.0,
    clip_cov_ub: Annotated[Number, Doc("upper bound of the covariance of a candidate token")] = 5.0,
    seed: Annotated[Count, Doc("seed of the random pick among candidates")] = 0,
) -> PolicyLossOutput:
    """The clipped surrogate, with ``max(1, int(clip_cov_ratio * tokens))`` unclipped tokens of
    covariance in ``(lb, ub)``, drawn at random (``seed``), given zero loss and gradient."""
    if clip_cov_ratio <= 0 or clip_cov_lb >= clip_cov_ub:
        raise ValueError(f"clip_cov needs clip_cov_ratio > 0 and lb < ub, "
                         f"got {clip_cov_ratio}, {clip_cov_lb}, {clip_cov_ub}")
    base = clipped_surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                             dual_clip=dual_clip)
    with torch.no_grad():
        cov = token_covariance(advantages, logp, mask)
        candidates = mask.bool() & ~base.clipped_tokens & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        idx = candidates.flatten().nonzero().flatten()
        n = max(1, int(clip_cov_ratio * float(mask.sum())))
        gen = torch.Generator().manual_seed(int(seed) + len(idx))
        chosen = idx[torch.randperm(len(idx), generator=gen)[:n].to(idx.device)]
        keep = torch.ones(mask.numel(), dtype=base.loss_mat.dtype, device=mask.device)
        keep[chosen] = 0.0
        keep = keep.view_as(mask)
    base.loss_mat = base.loss_mat * keep
    base.extra = {"cov_clipped_frac": _frac(keep == 0, mask), "cov_candidate_frac": _frac(candidates, mask)}
    return base


@register_policy_loss("kl_cov")
def kl_cov_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_cov_ratio: Annotated[Fraction, Doc("share of tokens (largest covariance) given the KL term")] = 0.0002,
    ppo_kl_coef: Annotated[NonNegative, Doc("the KL term's coefficient")] = 0.1,
) -> PolicyLossOutput:
    """``-A * ratio`` (no clipping, as in verl) plus ``ppo_kl_coef * |logp - old_logp|`` on the
    ``max(1, int(kl_cov_ratio * tokens))`` tokens of largest covariance."""
    if kl_cov_ratio <= 0 or ppo_kl_coef < 0:
        raise ValueError(f"kl_cov needs kl_cov_ratio > 0 and ppo_kl_coef >= 0, got {kl_cov_ratio}, {ppo_kl_coef}")
    adv = per_token(advantages, logp)
    log_ratio = clamped_log_ratio(logp, old_logp)
    loss = -adv * torch.exp(log_ratio)
    with torch.no_grad():  # the largest covariances: the lowest of their negatives
        cov = token_covariance(advantages, logp, mask)
        picked = lowest_fraction(-cov, mask.bool(), kl_cov_ratio)
    loss = torch.where(picked, loss + ppo_kl_coef * log_ratio.abs(), loss)
    zero = torch.zeros((), device=logp.device)
    return PolicyLossOutput(
        loss_mat=loss, clipfrac=zero, clipfrac_low=zero, clipfrac_high=zero, dual_clipfrac=zero,
        approx_kl=masked_mean((old_logp - logp).detach(), mask),
        extra={"kl_penalised_frac": _frac(picked, mask),
               "abs_kl": masked_mean(log_ratio.detach().abs(), mask)},
    )
