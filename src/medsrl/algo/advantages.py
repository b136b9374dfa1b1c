"""Advantage estimators (GRPO, Dr.GRPO, RLOO, GDPO), their registry, and the GRPO+Entropy bonus.

Estimators are registered by name (verl style) so the config picks one with
``algorithm.advantage`` and passes its keyword options from
``algorithm.advantage_options``; the math itself lives in the pure functions below.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from medsrl.algo.logprobs import per_token

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass
class AdvantageInputs:
    """Everything an estimator may need; one object so estimators share one call signature.

    - ``scores`` [B]: the shaped sequence scores (what GRPO normalises).
    - ``group_ids`` long [B]: responses with the same id answer the same prompt.
    - ``terms``: named reward components, each [B], summing to ``scores`` (e.g. ``correct``,
      ``overlong``, ``meds``), for estimators that treat components separately (GDPO).
    - ``response_mask`` [B,T]: for token-level estimators.
    - ``reduce_sum``: sums a python float over distributed ranks (None: a single process), for
      estimators with batch-wide statistics; every rank must make the same calls in order.
    """

    scores: Tensor
    group_ids: Tensor
    terms: dict[str, Tensor]
    response_mask: Tensor
    reduce_sum: Callable[[float], float] | None = None


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {}


def register_advantage(name: str) -> Callable[[_F], _F]:
    """Decorator adding ``fn(inputs: AdvantageInputs, **options) -> Tensor`` as ``name``.

    A duplicate name is refused so a second estimator cannot silently replace the first.
    """

    def deco(fn: _F) -> _F:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return deco


def compute_advantages(name: str, inputs: AdvantageInputs, **options: Any) -> Tensor:
    """Advantages from the estimator registered as ``name``: [B], or [B,T] for token-level ones.

    Options are checked against the estimator's signature before the call, so a misspelt option
    is reported as a config error, while a TypeError raised inside the estimator stays one.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if fn is None:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}")
    try:
        inspect.signature(fn).bind(inputs, **options)
    except TypeError as e:
        raise ValueError(
            f"advantage estimator {name!r} does not accept options {sorted(options)} ({e}); "
            "they come from algorithm.advantage_options"
        ) from e
    return fn(inputs, **options)


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to 0..G-1 so groups can be reduced with index_add."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, uniq.numel()


def _group_sum(values: Tensor, inv: Tensor, num_groups: int) -> Tensor:
    """Per-group sum of ``values`` [B] for group indices ``inv`` in 0..num_groups-1."""
    return values.new_zeros(num_groups).index_add_(0, inv, values)


def _group_deviation(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """``score - group mean`` [B], the group sizes [G], group index [B] and group count G."""
    if scores.dim() != 1 or scores.shape != group_ids.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids must both be [B]")
    x = scores if scores.is_floating_point() else scores.float()
    inv, g = _group_index(group_ids)
    counts = _group_sum(torch.ones_like(x), inv, g)
    return x - (_group_sum(x, inv, g) / counts)[inv], counts, inv, g


def group_advantages(
    scores: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-response advantage ``(score - group mean) / (group std + eps)`` (GRPO).

    ``norm_by_std=False`` gives Dr.GRPO's ``score - group mean``, which drops the std division
    that up-weights near-uniform groups. The std is the *unbiased* (Bessel, n-1) std, like
    ``torch.std``. Groups may be ragged and their ids arbitrary and shuffled. A group of size 1
    gets advantage 0 (its own mean), and so does any group whose scores are all equal.
    """
    dev, counts, inv, g = _group_deviation(scores, group_ids)
    if not norm_by_std:
        return dev
    var = _group_sum(dev * dev, inv, g) / (counts - 1).clamp(min=1)
    return dev / (var.sqrt()[inv] + eps)


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: ``r_i - mean of the other responses of its group`` = ``n/(n-1) (r_i - mean)``.

    Leaving the response out keeps the baseline independent of its own reward, so the gradient
    estimate is unbiased (the plain group mean biases it by a factor (n-1)/n). No std division.
    A group of size 1 has no other response to compare with and gets 0.
    """
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
    """GDPO (arXiv 2601.05242): normalise each reward term within its group, then combine.

    Why: GRPO normalises the *sum* of the terms, so a term's influence depends on its raw scale
    against correctness (a small MEDS penalty is drowned, a large one swamps correctness), and
    distinct term combinations can collapse to the same advantage. Normalising each term on its
    own (``(r_k - mean_k) / (std_k + eps)``, as ``group_advantages``) decouples the scale: a
    term's influence is set only by its ``weights`` entry (default 1.0). A term constant within
    every group contributes nothing. The weighted sum is then whitened over the whole batch,
    ``(x - mean) / (std + eps)`` (unbiased std), so the advantage scale does not grow with the
    number of terms. With ``reduce_sum`` the batch sum, sum of squares and row count are summed
    over ranks (three calls, in that order, on every rank), so under DDP the whitening covers
    all ranks' rows. Returns [B] in the dtype of the terms.
    """
    if not terms:
        raise ValueError("gdpo_advantages needs at least one reward term")
    weights = {} if weights is None else weights
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


@register_advantage("grpo")
def _grpo(inputs: AdvantageInputs, *, eps: float = 1e-6) -> Tensor:
    """GRPO: group mean/std normalisation of the shaped scores."""
    return group_advantages(inputs.scores, inputs.group_ids, norm_by_std=True, eps=eps)


@register_advantage("drgrpo")
def _drgrpo(inputs: AdvantageInputs) -> Tensor:
    """Dr.GRPO: group mean only (no ``eps`` option: without the std division it has no use)."""
    return group_advantages(inputs.scores, inputs.group_ids, norm_by_std=False)


@register_advantage("rloo")
def _rloo(inputs: AdvantageInputs) -> Tensor:
    """RLOO: leave-one-out group baseline on the shaped scores."""
    return rloo_advantages(inputs.scores, inputs.group_ids)


@register_advantage("gdpo")
def _gdpo(
    inputs: AdvantageInputs, *, weights: dict[str, float] | None = None, eps: float = 1e-6
) -> Tensor:
    """GDPO on the named reward terms, whitened over all ranks via ``inputs.reduce_sum``."""
    return gdpo_advantages(
        inputs.terms, inputs.group_ids, weights=weights, eps=eps, reduce_sum=inputs.reduce_sum
    )


def advantage_change_fraction(shaped: Tensor, base: Tensor, response_mask: Tensor) -> float:
    """How much of the policy-gradient signal shaping rewrote: mean |shaped - base| over mean
    |base|, per response token (``[B]`` advantages count once per token of their response).

    ``base``: the advantages of the unshaped reward, no advantage shaping; ``shaped``: the ones
    the update uses. 0 when shaping changed nothing; 1 when the change is as large as the signal
    itself. NaN when there was no signal to change and shaping made some.
    """
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
