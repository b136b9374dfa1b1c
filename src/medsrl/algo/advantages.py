"""Advantage estimators (GRPO, Dr.GRPO, RLOO, GDPO, W-REINFORCE, Pass@k) and their registry, by name (verl style)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import torch
from pydantic import BaseModel
from torch import Tensor
from typing_extensions import Doc

from medsrl.algo.logprobs import per_token
from medsrl.settings import Positive, PositiveInt, below, settings_model

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass
class AdvantageInputs:
    """Everything an estimator may need; one object so estimators share one call signature."""

    scores: Tensor  # [B] shaped sequence scores (what GRPO normalises)
    group_ids: Tensor  # long [B]: the same id answers the same prompt
    terms: dict[str, Tensor]  # named reward components [B] summing to scores (what GDPO splits)
    response_mask: Tensor  # [B,T], for token-level estimators
    # sums a float over ranks (None: one process) for batch-wide statistics; same calls on every rank
    reduce_sum: Callable[[float], float] | None = None


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {}
# name -> the settings model of its keyword options (``algorithm.advantage_options``), checked at start
ADVANTAGE_OPTIONS: dict[str, type[BaseModel]] = {}


def register_advantage(name: str) -> Callable[[_F], _F]:
    """Decorator adding ``fn(inputs: AdvantageInputs, *, **options) -> Tensor`` as ``name``; its
    keyword-only arguments (annotated, with defaults) are its options."""

    def deco(fn: _F) -> _F:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        ADVANTAGE_OPTIONS[name] = settings_model(fn)
        return fn

    return deco


def compute_advantages(name: str, inputs: AdvantageInputs, **options: Any) -> Tensor:
    """Advantages from the estimator registered as ``name``: [B], or [B,T] for token-level ones
    (``options``: checked at start against ``ADVANTAGE_OPTIONS[name]``, algo/settings.py)."""
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if fn is None:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}")
    return fn(inputs, **options)


def _group_sum(values: Tensor, inv: Tensor, num_groups: int) -> Tensor:
    return values.new_zeros(num_groups).index_add_(0, inv, values)


def _group_deviation(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """``score - group mean`` [B], the group sizes [G], group index [B] and group count G."""
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids must both be [B]")
    x = scores if scores.is_floating_point() else scores.float()
    uniq, inv = torch.unique(group_ids, return_inverse=True)  # arbitrary ids -> 0..G-1
    g = uniq.numel()
    counts = _group_sum(torch.ones_like(x), inv, g)
    return x - (_group_sum(x, inv, g) / counts)[inv], counts, inv, g


def group_advantages(
    scores: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO's ``(score - group mean) / (group std + eps)`` (unbiased std); ``norm_by_std=False``:
    Dr.GRPO's ``score - group mean``, without the division that up-weights near-uniform groups.
    Groups may be ragged, ids arbitrary; a singleton or all-equal group gets 0."""
    dev, counts, inv, g = _group_deviation(scores, group_ids)
    if not norm_by_std:
        return dev
    var = _group_sum(dev * dev, inv, g) / (counts - 1).clamp(min=1)
    return dev / (var.sqrt()[inv] + eps)


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: ``r_i - mean of the others in its group`` = ``n/(n-1) (r_i - mean)``, no std: a
    baseline free of the response's own reward keeps the gradient unbiased. A singleton gets 0."""
    dev, counts, inv, _ = _group_deviation(scores, group_ids)
    # n = 1: dev is already 0, the clamp only avoids 1/0
    return dev * (counts / (counts - 1).clamp(min=1))[inv]


def gdpo_advantages(
    terms: dict[str, Tensor],
    group_ids: Tensor,
    *,
    weights: dict[str, float] | None = None,
    eps: float = 1e-6,
    reduce_sum: Callable[[float], float] | None = None,
) -> Tensor:
    """GDPO (arXiv 2601.05242): each reward term normalised within its group, so that its
    ``weights`` entry (default 1.0), not its raw scale, sets its influence; the weighted sum is
    whitened over the batch (unbiased std; ``reduce_sum``: the sums over ranks)."""
    if not terms:
        raise ValueError("gdpo_advantages needs at least one reward term")
    weights = weights or {}
    unknown = sorted(set(weights) - set(terms))
    if unknown:
        raise ValueError(f"gdpo weights for unknown terms {unknown}; terms are {sorted(terms)}")
    x = sum(
        weights.get(k, 1.0) * group_advantages(r, group_ids, norm_by_std=True, eps=eps)
        for k, r in terms.items()
    )
    # float64: the sums of equal float32 values are exact, so a zero-spread batch gives 0, not
    # rounding noise divided by eps
    x64 = x.double()
    stats = [x64.sum().item(), (x64 * x64).sum().item(), float(x64.numel())]
    if reduce_sum is not None:
        stats = [reduce_sum(v) for v in stats]
    total, total_sq, n = stats
    mean = total / n if n > 0 else 0.0
    var = max(total_sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return ((x64 - mean) / (math.sqrt(var) + eps)).to(x.dtype)


def w_reinforce_advantages(scores: Tensor, correct: Tensor, *, positive_weight: float = 0.1) -> Tensor:
    """W-REINFORCE (arXiv 2506.01347): REINFORCE on the reward itself, no baseline, the correct
    responses' term weighted down: ``positive_weight * score`` if correct, ``score - 1`` if wrong
    (a shaping term rides on its side: MEDS's ``p`` makes ``-1 - p``, as in the authors' code)."""
    x = scores if scores.is_floating_point() else scores.float()
    return torch.where(correct.to(torch.bool), positive_weight * x, x - 1.0)


def passk_advantages(scores: Tensor, group_ids: Tensor, k: int) -> Tensor:
    """Pass@k training's analytical advantage (arXiv 2508.10751) per group of ``n``: ``R`` is the
    mean over its k-subsets of their best score, ``sigma`` that best score's std, and a response
    gets ``(mean best score of the k-subsets holding it - R) / sigma``: the paper's closed form on
    0/1 scores, and shaping terms (overlong, MEDS) take part. ``sigma = 0`` gives 0; ``k > n``: ``k = n``."""
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids must both be [B]")
    x = scores.detach().double().cpu()
    out = torch.zeros_like(x)
    _, inv = torch.unique(group_ids.cpu(), return_inverse=True)
    for g in range(int(inv.max()) + 1 if inv.numel() else 0):
        rows = (inv == g).nonzero().flatten()
        out[rows] = _passk_group(x[rows], k)
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    return out.to(device=scores.device, dtype=dtype)


def _passk_group(v: Tensor, k: int) -> Tensor:
    n = len(v)
    k = min(k, n)
    if n < 2 or bool(v.max() == v.min()):
        return torch.zeros_like(v)
    s, order = torch.sort(v)
    # the i-th smallest (i = 1..n) is the best of C(i-1, k-1) of the C(n, k) subsets
    p = torch.tensor([math.comb(i - 1, k - 1) / math.comb(n, k) for i in range(1, n + 1)], dtype=torch.float64)
    value = (p * s).sum()
    sigma = float((p * (s - value) ** 2).sum().sqrt())
    if sigma < 1e-12:
        return torch.zeros_like(v)
    if k == 1:
        held = s
    else:
        # the others of a subset holding the response: k-1 of the n-1 others, whose i-th smallest
        # is their best in C(i-1, k-2) of C(n-1, k-1) ways
        q = torch.tensor([math.comb(i - 1, k - 2) / math.comb(n - 1, k - 1) for i in range(1, n)],
                         dtype=torch.float64)
        cols = torch.arange(n - 1)
        others = s[cols[None, :] + (cols[None, :] >= torch.arange(n)[:, None]).long()]  # [n, n-1], sorted
        held = (torch.maximum(s[:, None], others) * q).sum(1)
    out = torch.empty_like(v)
    out[order] = (held - value) / sigma
    return out


@register_advantage("grpo")
def _grpo(inputs: AdvantageInputs, *, eps: Annotated[Positive, Doc("added to the group std")] = 1e-6) -> Tensor:
    return group_advantages(inputs.scores, inputs.group_ids, norm_by_std=True, eps=eps)


@register_advantage("drgrpo")
def _drgrpo(inputs: AdvantageInputs) -> Tensor:
    """No ``eps`` option: without the std division it has no use."""
    return group_advantages(inputs.scores, inputs.group_ids, norm_by_std=False)


@register_advantage("rloo")
def _rloo(inputs: AdvantageInputs) -> Tensor:
    return rloo_advantages(inputs.scores, inputs.group_ids)


@register_advantage("gdpo")
def _gdpo(
    inputs: AdvantageInputs,
    *,
    weights: Annotated[dict[str, float] | None, Doc("each reward term's weight; null: all 1")] = None,
    eps: Annotated[Positive, Doc("added to each std")] = 1e-6,
) -> Tensor:
    return gdpo_advantages(inputs.terms, inputs.group_ids, weights=weights, eps=eps, reduce_sum=inputs.reduce_sum)


@register_advantage("w_reinforce")
def _w_reinforce(
    inputs: AdvantageInputs,
    *,
    positive_weight: Annotated[Positive, Doc(
        "lambda, the weight of a correct response's reward (a wrong one gets -1); paper: 0.1")] = 0.1,
) -> Tensor:
    """Correct: the ``correct`` term, else the score, above 0.5."""
    correct = inputs.terms.get("correct", inputs.scores) > 0.5
    return w_reinforce_advantages(inputs.scores, correct, positive_weight=positive_weight)


@register_advantage("passk")
def _passk(
    inputs: AdvantageInputs,
    *,
    k: Annotated[below(PositiveInt, "rollout.n", or_equal=True), Doc(
        "k of the pass@k the group is trained for (<= rollout.n); 1 is GRPO with the population std")] = 4,
) -> Tensor:
    return passk_advantages(inputs.scores, inputs.group_ids, k)


def advantage_change_fraction(shaped: Tensor, base: Tensor, response_mask: Tensor) -> float:
    """How much of the policy-gradient signal shaping rewrote: mean |shaped - base| over mean
    |base| per response token; NaN when shaping made a signal where there was none. On the host:
    the step's tensors may sit on two devices."""
    shaped, base, response_mask = (t.detach().cpu() for t in (shaped, base, response_mask))
    mask = response_mask.to(torch.float64)
    shaped, base = per_token(shaped, response_mask).double(), per_token(base, response_mask).double()
    tokens = mask.sum()
    if tokens == 0:
        return 0.0
    change = float(((shaped - base).abs() * mask).sum() / tokens)
    signal = float((base.abs() * mask).sum() / tokens)
    if signal == 0.0:
        return 0.0 if change == 0.0 else float("nan")
    return change / signal
