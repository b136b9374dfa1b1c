"""Policy losses and their registry: PPO clipped surrogate (DAPO clip-higher, dual-clip).
``algorithm.policy_loss`` picks one by name (verl style), with ``algorithm.policy_loss_options``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from medsrl.algo.logprobs import TokenReducer, masked_mean, per_token


@dataclass
class PolicyLossOutput:
    """Per-token loss plus detached scalar diagnostics (fractions are over masked tokens)."""

    loss_mat: Tensor  # [B,T] per-token loss, unmasked (the caller aggregates)
    clipfrac: Tensor  # the PPO max picked -A * clip(ratio) strictly: clipfrac_low + clipfrac_high
    clipfrac_low: Tensor  # A < 0 and ratio < 1 - clip_low
    clipfrac_high: Tensor  # A > 0 and ratio > 1 + clip_high
    dual_clipfrac: Tensor  # A < 0 and the cap -A * dual_clip active (0 without dual-clip)
    approx_kl: Tensor  # masked mean of old_logp - logp (k1 estimate of KL(old || new))
    extra: dict[str, Tensor] = field(default_factory=dict)  # logged as train/<loss name>/<key>
    clipped_tokens: Tensor | None = None  # [B,T] bool, what clipfrac counts (None: no clipping)


_F = TypeVar("_F", bound=Callable[..., PolicyLossOutput])

POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {}
# name -> {stat name: factory(**its options) -> TokenReducer}: what a loss needs from the
# scoring forward (Lp-Reg's proxy log-probs). The loss receives each stat as a keyword argument.
POLICY_LOSS_STATS: dict[str, dict[str, Callable[..., TokenReducer]]] = {}

# Passed by the caller to every registered loss, whatever the loss options are.
_CLIP_KWARGS = ("clip_low", "clip_high", "dual_clip")


def register_policy_loss(
    name: str, token_stats: dict[str, Callable[..., TokenReducer]] | None = None
) -> Callable[[_F], _F]:
    """Decorator adding ``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high,
    dual_clip, **options) -> PolicyLossOutput`` as ``name``. ``token_stats``: per-token
    quantities of the old policy the loss gets as keyword arguments, each built by a factory from
    the loss options its signature names. Refused here, not blamed later on the options: a
    duplicate name and a loss that cannot take the clip keywords or its stats.
    """
    stats = dict(token_stats or {})

    def deco(fn: _F) -> _F:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        names = _CLIP_KWARGS + tuple(stats)
        try:
            inspect.signature(fn).bind_partial(**dict.fromkeys(names))
        except TypeError as e:
            raise ValueError(f"policy loss {name!r} must accept keyword arguments {names}") from e
        POLICY_LOSSES[name] = fn
        POLICY_LOSS_STATS[name] = stats
        return fn

    return deco


def _factory_options(factory: Callable[..., TokenReducer]) -> set[str]:
    return set(inspect.signature(factory).parameters)


def policy_loss_reducers(name: str, options: dict[str, Any]) -> dict[str, TokenReducer]:
    """The per-token reducers the loss ``name`` needs from the scoring forward, built from
    ``options`` (``algorithm.policy_loss_options``); empty for most losses."""
    _lookup(name)
    out = {}
    for stat, factory in POLICY_LOSS_STATS[name].items():
        own = {k: v for k, v in options.items() if k in _factory_options(factory)}
        try:
            out[stat] = factory(**own)
        except (TypeError, ValueError) as e:
            raise ValueError(f"policy loss {name!r}: bad options for its token stat {stat!r}: {e}") from e
    return out


def _lookup(name: str) -> Callable[..., PolicyLossOutput]:
    fn = POLICY_LOSSES.get(name)
    if fn is None:
        valid = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(f"unknown policy loss {name!r}; valid names: {valid}")
    return fn


def compute_policy_loss(
    name: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **options: Any
) -> PolicyLossOutput:
    """Per-token loss from the policy loss registered as ``name``; ``advantages`` [B] or [B,T].
    ``options`` less those of its token stats' factories are bound to its signature first: a
    misspelt option is a config error, while a TypeError raised inside the loss stays one."""
    fn = _lookup(name)
    taken = set().union(*(_factory_options(f) for f in POLICY_LOSS_STATS[name].values()))
    options = {k: v for k, v in options.items() if k not in taken}
    try:
        inspect.signature(fn).bind(logp, old_logp, advantages, mask, **options)
    except TypeError as e:
        raise ValueError(
            f"policy loss {name!r} does not accept options {sorted(options)} ({e}); "
            "they come from algorithm.policy_loss_options"
        ) from e
    return fn(logp, old_logp, advantages, mask, **options)


def clamped_log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """``logp - old_logp`` clamped to [-20, 20], so that ``exp`` of it (the importance ratio)
    stays finite; every policy loss takes its ratio from here."""
    return (logp - old_logp).clamp(-20.0, 20.0)


@register_policy_loss("vanilla")
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
    """Per-token PPO loss ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``; a larger
    ``clip_high`` (DAPO clip-higher) lets low-probability tokens grow, against entropy collapse;
    ``dual_clip`` (> 1) caps the loss of ``A < 0`` tokens at ``-A * dual_clip``, so a huge ratio on
    a bad token cannot dominate the update."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = per_token(advantages, logp)
    ratio = torch.exp(clamped_log_ratio(logp, old_logp))
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
        loss_mat=loss, clipfrac=_frac(clipped, mask), clipfrac_low=_frac(low, mask),
        clipfrac_high=_frac(high, mask), dual_clipfrac=_frac(dual, mask),
        approx_kl=masked_mean((old_logp - logp).detach(), mask), clipped_tokens=clipped.expand_as(mask),
    )


def _frac(flags: Tensor, mask: Tensor) -> Tensor:
    """Fraction of masked tokens where ``flags`` is set (flags may broadcast to the mask)."""
    return masked_mean(flags.expand_as(mask).float(), mask)
