"""The tiny preset: a Qwen2-architecture causal LM built from a config, no weights needed."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from medsrl.models.char_tokenizer import char_vocab


def tiny_qwen2_config(hidden_size: int = 128, num_hidden_layers: int = 4, num_attention_heads: int = 4,
                      num_key_value_heads: int = 2, intermediate_size: int = 512,
                      max_position_embeddings: int = 1024, vocab_size: int | None = None) -> Qwen2Config:
    """A small Qwen2 config sized for the char tokenizer (about 1M parameters by default)."""
    return Qwen2Config(
        vocab_size=vocab_size or len(char_vocab()), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, bos_token_id=None, eos_token_id=2,
    )


def build_tiny_model(seed: int = 0, **config_overrides) -> Qwen2ForCausalLM:
    """A randomly initialised tiny Qwen2 model (seeded, so tests are reproducible)."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen2_config(**config_overrides))
