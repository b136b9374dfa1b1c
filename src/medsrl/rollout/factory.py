"""Pick the rollout engine that ``rollout.backend`` names."""

from __future__ import annotations

from dataclasses import asdict

import torch
from transformers import PreTrainedTokenizerBase

from medsrl.config import RolloutConfig
from medsrl.rollout.base import RolloutEngine
from medsrl.rollout.hf import HFRolloutEngine

BACKENDS = ("hf", "vllm")


def build_engine(
    cfg: RolloutConfig, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, seed: int = 0
) -> RolloutEngine:
    """The engine for ``cfg.backend``, serving ``policy``'s current weights.

    vLLM is imported only when asked for: the main environment does not have it.
    """
    if cfg.backend == "hf":
        return HFRolloutEngine(policy, tokenizer, max_batch_size=cfg.max_batch_size)
    if cfg.backend == "vllm":
        from medsrl.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(policy, tokenizer, seed=seed, **asdict(cfg.vllm))
    raise ValueError(f"rollout.backend={cfg.backend!r}; valid: {', '.join(BACKENDS)}")
