"""Build the policy and tokenizer a run trains, from the ``model`` config group."""

from __future__ import annotations

import logging
from typing import Any

from medsrl.models.loading import load_policy, load_tokenizer, random_model_like, resolve_dtype
from medsrl.models.lora import apply_lora, lora_settings

log = logging.getLogger(__name__)


def build_policy(model_cfg: dict[str, Any]):
    """``(policy, tokenizer)``: the Hugging Face model ``name_or_path`` names (the warm-started
    tiny preset among them), else the tiny preset; a ``PeftModel`` with ``lora.r > 0``."""
    cfg = dict(model_cfg)
    name = cfg.get("name_or_path")
    dtype = cfg.get("dtype", "float32")
    attn = cfg.get("attn_implementation")
    tokenizer = load_tokenizer(cfg.get("tokenizer") or name)
    if cfg.get("random_init"):
        policy = random_policy(cfg, dtype, attn)
    else:
        policy = load_policy(
            name,
            tiny=dict(cfg.get("tiny") or {}),
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=bool(cfg.get("trust_remote_code", False)),
        )
    if cfg.get("gradient_checkpointing"):
        enable_activation_checkpointing(policy)
    lora = lora_settings(cfg)
    if lora.enabled:  # after checkpointing: PEFT needs to know whether it is on
        policy = apply_lora(policy, lora)
        trainable, total = policy.get_nb_trainable_parameters()
        log.info("model.lora: r=%d adapters on %s, %d trainable of %d parameters", lora.r,
                 lora.target_modules, trainable, total)
    return policy, tokenizer


def random_policy(cfg: dict[str, Any], dtype, attn: str | None):
    """``model.random_init=true``: ``model.architecture`` at the shape of ``model.shape`` with
    random weights, for smoke runs and memory or speed checks without a checkpoint (the tokenizer
    still comes from ``model.tokenizer`` or ``name_or_path``)."""
    if not cfg.get("architecture") or not cfg.get("shape"):
        raise ValueError("model.random_init=true needs model.architecture and model.shape (see configs/model/)")
    shape = dict(cfg["shape"])
    vocab = int(shape.pop("vocab_size"))
    if attn:
        shape["attn_implementation"] = attn
    log.info("model.random_init: a random %s of shape %s", cfg["architecture"], shape)
    return random_model_like(str(cfg["architecture"]), vocab, **shape).to(resolve_dtype(dtype))


def enable_activation_checkpointing(policy) -> None:
    """Recompute each decoder layer's activations in the backward of a training-mode forward, the
    non-reentrant way (keyword inputs, inputs without grad and FSDP units all work with it).
    Eval-mode forwards (generation, scoring) are untouched and keep their KV cache."""
    kwargs = {"use_reentrant": False}
    enable = getattr(policy, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
