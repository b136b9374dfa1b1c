"""``rollout``: how training samples, and the vLLM engine's options."""

from pydantic import Field

from medsrl.settings import Flag, Fraction, Positive, PositiveInt, Settings, Text, nullable, one_of

BACKENDS = ("hf", "vllm")

class VLLMConfig(Settings):
    """On the CPU build ``gpu_memory_utilization`` is a fraction of host memory: size the KV cache
    with ``kv_cache_memory_bytes`` there instead."""

    gpu_memory_utilization: Fraction = 0.5
    """Colocated: the trainer needs the rest."""
    kv_cache_memory_bytes: nullable(PositiveInt) = None
    """Overrides gpu_memory_utilization when set."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs one engine spans."""
    enforce_eager: Flag = False
    """True: no CUDA graphs / torch.compile (faster start)."""
    enable_sleep_mode: Flag = False
    """Free weights + KV cache between rollouts (GPU builds)."""
    dtype: Text = "auto"
    """Auto: the policy's dtype."""
    max_model_len: nullable(PositiveInt) = None
    """None: rollout.max_prompt_tokens + max_new_tokens, at most the model's positions."""
    per_request_seeds: Flag = False
    """True: a seed per response (reproducible per shard; slower)."""


class RolloutConfig(Settings):
    """Sampling settings for training rollouts (validation has its own: callbacks.pass_at_k)."""

    backend: one_of(BACKENDS) = "hf"
    """The engine: hf (transformers generate, CPU and GPU) or vllm (GPU)."""
    n: PositiveInt = 8
    """Responses per prompt (the GRPO group)."""
    temperature: Positive = 1.0
    """Sampling temperature."""
    top_p: Fraction = 1.0
    """Nucleus sampling."""
    max_new_tokens: PositiveInt = 256
    """Tokens a response may have (DAPO's overlong penalty counts from it)."""
    max_batch_size: PositiveInt = 64
    """Sequences per generate call."""
    max_prompt_tokens: PositiveInt = 2048
    """With max_new_tokens, the engine's max_model_len (at most the model's positions); data
    prompts longer than max_model_len - max_new_tokens are dropped at load, for both backends."""
    logprobs: Flag = False
    """Engine sampling log-probs, logged against the trainer's (train/engine/*)."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vLLM engine's options."""

