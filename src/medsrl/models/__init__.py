"""Tokenizers and policies: the tiny char-level CPU preset and real Hugging Face models."""

from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.loading import (
    ModelLoadError,
    load_policy,
    load_tokenizer,
    random_model_like,
    resolve_dtype,
    stop_token_ids,
)
from medsrl.models.tiny import build_tiny_model, tiny_qwen2_config

__all__ = [
    "ModelLoadError",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_policy",
    "load_tokenizer",
    "random_model_like",
    "resolve_dtype",
    "stop_token_ids",
    "tiny_qwen2_config",
]
