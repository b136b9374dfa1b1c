"""Pick the rollout engine that ``rollout.backend`` names."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from medsrl.config import RolloutConfig
from medsrl.rollout.base import RolloutEngine
from medsrl.rollout.hf import HFRolloutEngine

BACKENDS = ("hf", "vllm")


def engine_max_model_len(cfg: RolloutConfig, policy: torch.nn.Module) -> int | None:
    """``rollout.vllm.max_model_len``, else the prompt and response budgets (capped at the model's
    positions): the engine's buffers sized for the sequences it will see, not the model's 40k."""
    if cfg.vllm.max_model_len is not None:
        return cfg.vllm.max_model_len
    budget = cfg.max_prompt_tokens + cfg.max_new_tokens
    positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    return budget if positions is None else min(budget, int(positions))


def build_engine(
    cfg: RolloutConfig, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, seed: int = 0
) -> RolloutEngine:
    """The engine for ``cfg.backend``, serving ``policy``'s current weights (vLLM imported only
    when asked for: the main environment does not have it)."""
    if cfg.backend == "hf":
        return HFRolloutEngine(policy, tokenizer, max_batch_size=cfg.max_batch_size)
    if cfg.backend == "vllm":
        from medsrl.rollout.vllm import VLLMRolloutEngine

        options = cfg.vllm.model_dump() | {"max_model_len": engine_max_model_len(cfg, policy)}
        return VLLMRolloutEngine(policy, tokenizer, seed=seed, **options)
    raise ValueError(f"rollout.backend={cfg.backend!r}; valid: {', '.join(BACKENDS)}")
