"""Typed settings of one RL run, built from the Hydra config groups of the same names.

The module takes plain dicts (what Hydra gives) and turns them into these dataclasses, so a
misspelt key fails at start with the name of the key, not deep inside a step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from medsrl.algo.aggregation import LOSS_AGG_MODES


@dataclass
class AlgorithmConfig:
    """The RL loss: an advantage estimator and a policy loss from the registries (by name),
    their settings, and the update's batching. GRPO, DAPO, Dr.GRPO and MEDS are presets of these
    plus the plug-ins of ``algorithm.plugins`` (built by ``train.py``, not here)."""

    name: str = "dapo"
    advantage: str = "grpo"  # algo.ADVANTAGE_ESTIMATORS: grpo, drgrpo, rloo, gdpo
    advantage_options: dict[str, Any] = field(default_factory=dict)  # e.g. gdpo {weights: {...}}
    policy_loss: str = "vanilla"  # algo.POLICY_LOSSES
    policy_loss_options: dict[str, Any] = field(default_factory=dict)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 10.0
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0  # > 0 adds a KL loss against a frozen reference model
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_prompts: int | None = None  # prompts per optimiser update; None = the whole step
    micro_batch_size: int = 32  # sequences per forward/backward (at most)
    # padded tokens per forward/backward (rows x their longest prompt + response); None: cut by
    # micro_batch_size alone, in row order. Set: rows sorted by length, cut by this budget
    # (step/micro_batches.py), each micro-batch as wide as its own longest row
    max_tokens_per_microbatch: int | None = None
    # truncated importance sampling of the rollout engine's sampling mismatch: the policy-gradient
    # term of each token weighted by min(pi_old / pi_engine, cap) (algo/engine_correction.py).
    # None: off. Needs rollout.logprobs (the engine's own log-probs)
    engine_is_cap: float | None = None

    def __post_init__(self) -> None:
        from medsrl.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

        if self.advantage not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"algorithm.advantage={self.advantage!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"algorithm.policy_loss={self.policy_loss!r}; valid: {sorted(POLICY_LOSSES)}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode={self.loss_agg_mode!r}; valid: {LOSS_AGG_MODES}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"algorithm.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if self.micro_batch_size < 1 or self.ppo_epochs < 1:
            raise ValueError("algorithm.micro_batch_size and algorithm.ppo_epochs must be >= 1")
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            raise ValueError(f"algorithm.max_tokens_per_microbatch must be >= 1 or null, got {self.max_tokens_per_microbatch}")
        if self.engine_is_cap is not None and self.engine_is_cap <= 0:
            raise ValueError(f"algorithm.engine_is_cap must be > 0 or null, got {self.engine_is_cap}")
        self.advantage_options = dict(self.advantage_options or {})
        self.policy_loss_options = dict(self.policy_loss_options or {})


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
    max_model_len: int | None = None  # None: rollout.max_prompt_tokens + max_new_tokens
    per_request_seeds: bool = False  # True: a seed per response (reproducible per shard; slower)


@dataclass
class RolloutConfig:
    """Sampling settings for training rollouts (validation has its own: callbacks.pass_at_k)."""

    backend: str = "hf"  # hf | vllm
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    max_batch_size: int = 64  # sequences per generate call
    max_prompt_tokens: int = 2048  # the longest prompt the vLLM engine is sized for (max_model_len)
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
    # runaway guard (algo/guard.py): stop when the weights' norm exceeds this many times its
    # value at the fit's first update; 0 leaves only the non-finite check
    max_param_norm_growth: float = 100.0


@dataclass
class GraderConfig:
    """Math grading: hard per-answer timeout, in worker processes."""

    timeout_s: float = 5.0
    num_workers: int | None = None  # None: grader_workers(), one per core of this process
    # Reasoning models (R1-Distill, Qwen3 thinking): grade only the text after the last
    # occurrence of this tag; a response that never writes it scores 0 (counted). None: all of it.
    reasoning_end: str | None = None

    def workers(self, processes_per_node: int = 1) -> int:
        """The worker count: the configured one, else :func:`grader_workers`."""
        return self.num_workers if self.num_workers is not None else grader_workers(processes_per_node)


MAX_GRADER_WORKERS = 16


def grader_workers(processes_per_node: int = 1) -> int:
    """One grader worker per core this process may use, the node's cores split between its
    training processes, at most ``MAX_GRADER_WORKERS``: math-verify is CPU-bound, and grading
    runs between generation and the update, when the cores are otherwise idle."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_GRADER_WORKERS, cores // max(1, processes_per_node)))


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
    if cls is RolloutConfig and values.get("vllm") is not None and not isinstance(values["vllm"], VLLMConfig):
        values["vllm"] = build(VLLMConfig, values["vllm"], f"{section}.vllm")
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    return cls(**values)


def to_dict(obj) -> dict[str, Any]:
    """A dataclass as a plain dict (for hparams)."""
    return asdict(obj)
