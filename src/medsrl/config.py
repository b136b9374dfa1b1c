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
class MedsConfig:
    """MEDS (PAPER.md): per-prompt memory of answer-token logit features, HDBSCAN clusters, and a
    penalty ``min(alpha * ln(|C| + 1), beta)`` on targeted responses. Defaults = the reference."""

    alpha: float = 0.1
    beta: float | None = None  # None: 2 * alpha, as in the reference
    layers: Any = 14  # last N layers, "half", "all", or a list of 1-based layer numbers
    diff: bool = False  # first differences across the selected layers
    final_norm: bool = False  # final norm on intermediate layers (a textbook logit lens)
    target: str = "wrong"  # wrong | right | both | none
    noise_is_cluster: bool = True  # noise counts as one cluster (reference); False: no penalty
    k: int = 3  # nearest neighbours in the label vote
    min_cluster_size: int = 2
    min_samples: int = 1
    cap_per_key: int | None = None  # oldest out past this many entries per (key, correctness)
    mode: str = "cluster"  # cluster | single (ablation: size = the key's whole history)
    refit: str = "background"  # background | sync (reference order)
    refit_workers: int = 1
    reset_on_stage_change: bool = False
    snapshot_every_n_steps: int = 20  # 0: no snapshots
    panels_every_n_steps: int = 10  # TensorBoard histogram and text panel; 0: off

    def __post_init__(self) -> None:
        if self.target not in ("wrong", "right", "both", "none"):
            raise ValueError(f"meds.target={self.target!r}; valid: wrong, right, both, none")
        if self.mode not in ("cluster", "single"):
            raise ValueError(f"meds.mode={self.mode!r}; valid: cluster, single")
        if self.refit not in ("background", "sync"):
            raise ValueError(f"meds.refit={self.refit!r}; valid: background, sync")
        if self.alpha < 0 or self.k < 1:
            raise ValueError("meds.alpha must be >= 0 and meds.k >= 1")


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
    meds: MedsConfig | None = None  # set (algorithm=meds): the MEDS callbacks join the run

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode={self.loss_agg_mode!r}; valid: {LOSS_AGG_MODES}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"algorithm.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if self.micro_batch_size < 1 or self.ppo_epochs < 1:
            raise ValueError("algorithm.micro_batch_size and algorithm.ppo_epochs must be >= 1")


@dataclass
class VLLMConfig:
    """Engine settings of the vLLM backend (``rollout.backend=vllm``); the HF backend ignores them.

    On the CPU build ``gpu_memory_utilization`` is a fraction of host memory; set
    ``kv_cache_memory_bytes`` there instead to size the KV cache exactly.
    """

    gpu_memory_utilization: float = 0.5  # colocated: the trainer needs the rest
    kv_cache_memory_bytes: int | None = None  # overrides gpu_memory_utilization when set
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no CUDA graphs / torch.compile (faster start)
    enable_sleep_mode: bool = False  # free weights + KV cache between rollouts (GPU builds)
    dtype: str = "auto"  # auto: the policy's dtype
    max_model_len: int | None = None  # None: the model's max_position_embeddings


@dataclass
class RolloutConfig:
    """Sampling settings for training rollouts (validation has its own: callbacks.pass_at_k)."""

    backend: str = "hf"  # hf | vllm
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_batch_size: int = 64  # sequences per generate call
    logprobs: bool = False  # engine sampling log-probs, logged against the trainer's (train/engine/*)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


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
    nested = {
        DynamicSamplingConfig: "dynamic_sampling",
        OverlongConfig: "overlong",
        MedsConfig: "meds",
        VLLMConfig: "vllm",
    }
    for sub_cls, name in nested.items():
        if values.get(name) is not None and name in known and not isinstance(values[name], sub_cls):
            values[name] = build(sub_cls, values[name], f"{section}.{name}")
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return cls(**values)


def to_dict(obj) -> dict[str, Any]:
    """A dataclass as a plain dict (for hparams)."""
    return asdict(obj)
