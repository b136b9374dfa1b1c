"""Build the policy and tokenizer a run trains, from the ``model`` config group."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from medsrl.models.loading import load_policy, load_tokenizer, random_model_like, resolve_dtype
from medsrl.models.lora import apply_lora
from medsrl.models.settings import ModelConfig
from medsrl.models.tiny import build_tiny_model

log = logging.getLogger(__name__)


def build_policy(model: ModelConfig, on_meta: bool = False, precision: str | int = "32-true"):
    """``(policy, tokenizer)``; with LoRA the frozen base in ``model.weights_dtype(precision)`` and the
    adapters in ``model.dtype``. ``on_meta``: no weights read (an FSDP rank that receives its shards)."""
    tokenizer = load_tokenizer(model.tokenizer or model.name_or_path)
    dtype = model.weights_dtype(precision)
    if on_meta:
        policy = meta_model(model)
        if isinstance(resolve_dtype(dtype), torch.dtype):  # as rank 0 loads it
            policy = policy.to(resolve_dtype(dtype))
        if model.attn_implementation:
            policy.set_attn_implementation(model.attn_implementation)
    elif model.random_init:
        policy = random_policy(model, dtype)
    else:
        policy = load_policy(model.name_or_path, tiny=dict(model.tiny or {}), dtype=dtype,
                             attn_implementation=model.attn_implementation,
                             trust_remote_code=model.trust_remote_code)
    if model.gradient_checkpointing:
        enable_activation_checkpointing(policy)
    lora = model.lora
    if lora.enabled:  # after checkpointing: PEFT needs to know whether it is on
        policy = apply_lora(policy, lora, adapter_dtype=resolve_dtype(model.dtype))
        trainable, total = policy.get_nb_trainable_parameters()
        log.info("model.lora: r=%d adapters on %s, %d trainable of %d parameters; the base in %s", lora.r,
                 lora.target_modules, trainable, total, dtype)
    return policy, tokenizer


def random_policy(model: ModelConfig, dtype: str | None = None):
    """``model.random_init=true``: smoke runs and memory or speed checks without a checkpoint."""
    if not model.architecture or not model.shape:
        raise ValueError("model.random_init=true needs model.architecture and model.shape (see configs/model/)")
    shape = dict(model.shape)
    vocab = int(shape.pop("vocab_size"))
    if model.attn_implementation:
        shape["attn_implementation"] = model.attn_implementation
    log.info("model.random_init: a random %s of shape %s", model.architecture, shape)
    return random_model_like(model.architecture, vocab, **shape).to(resolve_dtype(dtype or model.dtype))


def enable_activation_checkpointing(policy) -> None:
    """Non-reentrant: keyword inputs, inputs without grad and FSDP units all work with it. Eval-mode
    forwards (generation, scoring) are untouched and keep their KV cache."""
    kwargs = {"use_reentrant": False}
    enable = getattr(policy, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def meta_model(model: ModelConfig) -> torch.nn.Module:
    """The model's modules on the ``meta`` device, no storage."""
    name = model.name_or_path
    local = Path(str(name)).expanduser() / "config.json" if name else None
    with torch.device("meta"):
        if local is not None and local.is_file():
            from transformers import AutoConfig, AutoModelForCausalLM

            trust = model.trust_remote_code
            config = AutoConfig.from_pretrained(local.parent, trust_remote_code=trust)
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
        shape = dict(model.shape or {})
        if shape:
            if not model.architecture:
                raise ValueError("model.shape needs model.architecture (qwen2, qwen3, llama)")
            vocab = shape.pop("vocab_size")
            return random_model_like(model.architecture, vocab, **shape)
        if name is None:  # the tiny preset
            return build_tiny_model(**dict(model.tiny or {}))
    raise ValueError(f"model {name!r}: no shape to plan with; add model.shape (its config.json numbers: hidden_size, "
                     "num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, "
                     "tie_word_embeddings) or point model.name_or_path at a local copy")
