"""Pick the rollout engine that ``rollout.backend`` names."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from medsrl.rollout.base import RolloutEngine
from medsrl.rollout.hf import HFRolloutEngine
from medsrl.rollout.settings import BACKENDS, RolloutConfig


def model_positions(policy: torch.nn.Module) -> int | None:
    positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    return None if positions is None else int(positions)


def engine_max_model_len(cfg: RolloutConfig, policy: torch.nn.Module) -> int | None:
    """``rollout.vllm.max_model_len``, else the prompt and response budgets (capped at the model's
    positions): the engine's buffers sized for the sequences it will see, not the model's 40k."""
    if cfg.vllm.max_model_len is not None:
        return cfg.vllm.max_model_len
    budget = cfg.max_prompt_tokens + cfg.max_new_tokens
    positions = model_positions(policy)
    return budget if positions is None else min(budget, positions)


def prompt_token_limit(cfg: RolloutConfig, policy: torch.nn.Module) -> int | None:
    """The longest prompt either backend takes (vLLM refuses a longer one; HF would run silently past
    the model's positions): the data drops longer ones at load. None: no limit."""
    max_model_len = engine_max_model_len(cfg, policy)
    if max_model_len is None:
        return None
    limit = max_model_len - cfg.max_new_tokens
    if limit < 1:
        raise ValueError(f"no room for a prompt: {describe_prompt_token_limit(cfg, policy)} = {limit}; "
                         "lower rollout.max_new_tokens, or raise rollout.max_prompt_tokens (or "
                         "rollout.vllm.max_model_len) while the model's positions allow")
    return limit


def describe_prompt_token_limit(cfg: RolloutConfig, policy: torch.nn.Module) -> str:
    """How :func:`prompt_token_limit` is made, with the settings' values."""
    new = f"rollout.max_new_tokens {cfg.max_new_tokens}"
    if cfg.vllm.max_model_len is not None:
        return f"rollout.vllm.max_model_len {cfg.vllm.max_model_len} - {new}"
    budget = f"rollout.max_prompt_tokens {cfg.max_prompt_tokens} + {new}"
    positions = model_positions(policy)
    if positions is not None:
        budget = f"min({budget}, the model's {positions} positions)"
    return f"{budget} - {new}"


def build_engine(cfg: RolloutConfig, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                 seed: int = 0) -> RolloutEngine:
    """vLLM is imported only when asked for: the main environment does not have it."""
    if cfg.backend == "hf":
        return HFRolloutEngine(policy, tokenizer, max_batch_size=cfg.max_batch_size)
    if cfg.backend == "vllm":
        from medsrl.rollout.vllm import VLLMRolloutEngine

        options = cfg.vllm.model_dump() | {"max_model_len": engine_max_model_len(cfg, policy)}
        return VLLMRolloutEngine(policy, tokenizer, seed=seed, **options)
    raise ValueError(f"rollout.backend={cfg.backend!r}; valid: {', '.join(BACKENDS)}")
