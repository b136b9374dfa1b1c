"""Policy losses and their registry, by name (verl style): PPO clipped surrogate (DAPO clip-higher, dual-clip)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, create_model
from torch import Tensor

from medsrl.algo.logprobs import TokenReducer, masked_mean, per_token
from medsrl.settings import Settings, settings_model


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
# scoring forward (Lp-Reg's proxy log-probs), passed to it as keyword arguments
POLICY_LOSS_STATS: dict[str, dict[str, Callable[..., TokenReducer]]] = {}
# name -> the settings model of its own and its stats' factories' options, checked at start
POLICY_LOSS_OPTIONS: dict[str, type[BaseModel]] = {}

# Settings of ``algorithm`` itself, given to each loss whose signature names them.
CLIP_SETTINGS = ("clip_low", "clip_high", "dual_clip")


def register_policy_loss(
    name: str, token_stats: dict[str, Callable[..., TokenReducer]] | None = None
) -> Callable[[_F], _F]:
    """Decorator adding ``fn(logp, old_logp, advantages, mask, *, **options) -> PolicyLossOutput``
    as ``name``: its keyword-only arguments are its options, less ``CLIP_SETTINGS`` (passed from
    ``algorithm`` when named) and the ``token_stats`` (the old policy's, built by their factories)."""
    stats = dict(token_stats or {})

    def deco(fn: _F) -> _F:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        try:
            inspect.signature(fn).bind_partial(**dict.fromkeys(stats))
        except TypeError as e:
            raise ValueError(f"policy loss {name!r} must accept keyword arguments {tuple(stats)}") from e
        own = settings_model(fn, skip=CLIP_SETTINGS + tuple(stats))
        fields = {k: (f.annotation, f) for k, f in own.model_fields.items()}
        for factory in stats.values():
            fields.update({k: (f.annotation, f) for k, f in settings_model(factory).model_fields.items()})
        POLICY_LOSSES[name] = fn
        POLICY_LOSS_STATS[name] = stats
        POLICY_LOSS_OPTIONS[name] = create_model(fn.__name__, __base__=Settings, **fields)
        return fn

    return deco


def clip_settings(name: str, algo: Any) -> dict[str, Any]:
    taken = inspect.signature(_lookup(name)).parameters
    return {k: getattr(algo, k) for k in CLIP_SETTINGS if k in taken}


def _factory_options(factory: Callable[..., TokenReducer]) -> set[str]:
    return set(inspect.signature(factory).parameters)


def _own_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less those of the loss's stats' factories (not passed to the loss)."""
    taken = set().union(*(_factory_options(f) for f in POLICY_LOSS_STATS[name].values()))
    return {k: v for k, v in options.items() if k not in taken}


def policy_loss(algo: Any) -> Callable[..., PolicyLossOutput]:
    """``algo.policy_loss`` with its clip settings and own options bound, resolved once per run."""
    name = algo.policy_loss
    return partial(_lookup(name), **clip_settings(name, algo), **_own_options(name, algo.policy_loss_options))


def policy_loss_reducers(name: str, options: dict[str, Any]) -> dict[str, TokenReducer]:
    """The per-token reducers the loss ``name`` needs from the scoring forward; most need none."""
    _lookup(name)
    return {stat: factory(**{k: v for k, v in options.items() if k in _factory_options(factory)})
            for stat, factory in POLICY_LOSS_STATS[name].items()}


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
    ``options``: its own, its clip settings and token stats (its factories' are dropped)."""
    return _lookup(name)(logp, old_logp, advantages, mask, **_own_options(name, options))


def clamped_log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """``logp - old_logp`` clamped to [-20, 20]: the importance ratio ``exp`` of it stays finite."""
    return (logp - old_logp).clamp(-20.0, 20.0)


@register_policy_loss("vanilla")
def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> PolicyLossOutput:
    """Per-token PPO loss ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``; a larger
    ``clip_high`` (DAPO) lets rare tokens grow, against entropy collapse; ``dual_clip`` (> 1) caps
    an ``A < 0`` token's loss at ``-A * dual_clip``, so one huge ratio cannot dominate the update."""
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
    return masked_mean(flags.expand_as(mask).float(), mask)
