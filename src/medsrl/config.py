"""Typed settings of one RL run, built from the Hydra config groups of the same names.

The module takes plain dicts (what Hydra gives) and turns them into these dataclasses, so a
misspelt key fails at start with the name of the key, not deep inside a step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from medsrl.algo.aggregation import LOSS_AGG_MODES


@dataclass
class DynamicSamplingConfig:
    """DAPO: drop groups whose rewards do not differ; generate more prompts to refill."""

    enabled: bool = False
    max_rounds: int = 10  # extra generation rounds per step at most


@dataclass
class OverlongConfig:
    """DAPO's soft overlong penalty over the last ``buffer_length`` tokens of the budget."""

    enabled: bool = False
    buffer_length: int = 512
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    """Loss and advantage settings (GRPO, DAPO, Dr.GRPO are presets of these)."""

    name: str = "dapo"
    norm_adv_by_std: bool = True  # False = Dr.GRPO
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 10.0
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0  # > 0 adds a KL loss against a frozen reference model
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_prompts: int | None = None  # prompts per optimiser update; None = the whole step
    micro_batch_size: int = 32  # sequences per forward/backward
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode={self.loss_agg_mode!r}; valid: {LOSS_AGG_MODES}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"algorithm.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if self.micro_batch_size < 1 or self.ppo_epochs < 1:
            raise ValueError("algorithm.micro_batch_size and algorithm.ppo_epochs must be >= 1")


@dataclass
class RolloutConfig:
    """Sampling settings for training rollouts and for validation."""

    backend: str = "hf"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_batch_size: int = 64  # sequences per generate call
    val_n: int = 1
    val_temperature: float = 1.0
    val_top_p: float = 1.0


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then constant lr, stepped once per RL step."""

    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 10
    grad_clip: float = 1.0


@dataclass
class GraderConfig:
    """Math grading: hard per-answer timeout, in worker processes."""

    timeout_s: float = 5.0
    num_workers: int = 1


@dataclass
class LoggingConfig:
    """What the module logs beyond scalars."""

    samples_every_n_steps: int = 10
    num_samples: int = 4


def build(cls, values: dict[str, Any] | Any | None, section: str):
    """Instantiate dataclass ``cls`` from a dict, naming ``section`` in the error on a bad key."""
    if values is None:
        return cls()
    if isinstance(values, cls):
        return values
    values = dict(values)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) in {section}: {unknown}; known: {sorted(known)}")
    nested = {DynamicSamplingConfig: "dynamic_sampling", OverlongConfig: "overlong"}
    for sub_cls, name in nested.items():
        if name in values and name in known and not isinstance(values[name], sub_cls):
            values[name] = build(sub_cls, values[name], f"{section}.{name}")
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return cls(**values)


def to_dict(obj) -> dict[str, Any]:
    """A dataclass as a plain dict (for hparams)."""
    return asdict(obj)
