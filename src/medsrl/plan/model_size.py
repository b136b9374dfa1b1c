"""The sizes the memory plan needs, read from the model itself built on the ``meta`` device.

No formula per architecture: the model class of the config (Qwen2, Qwen3, Llama ...) is built
without storage, and its parameters are counted where FSDP would put them: each decoder layer
(the model's ``_no_split_modules``) is one unit, the rest (embeddings, final norm, LM head) the
root unit. Real models come from ``model.shape`` (the checkpoint's config.json numbers, in the
model config) or from a local ``name_or_path``'s config.json, which wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from medsrl.models.policy import meta_model
from medsrl.models.settings import ModelConfig


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts and the widths the activation and KV-cache arithmetic uses."""

    params: int  # all parameters (tied embeddings counted once)
    layer_params: int  # one decoder layer (the largest, if they differ)
    root_params: int  # outside the decoder layers: embeddings, final norm, LM head
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    q_width: int  # num_attention_heads * head_dim
    kv_width: int  # num_key_value_heads * head_dim
    trainable_params: int | None = None  # those with gradients and AdamW states; None: all (LoRA: the adapters')
    lora_largest_matrix: int = 0  # LoRA: elements of the largest adapted weight (merged one at a time); else 0
    largest_param: int = 0  # elements of the largest parameter (the embedding or LM head of a real model)

    @property
    def trained(self) -> int:
        """The parameters that have gradients and AdamW states."""
        return self.params if self.trainable_params is None else self.trainable_params

    @property
    def lora(self) -> bool:
        """Whether only LoRA adapters train (the base weights, the LM head included, are frozen)."""
        return self.trainable_params is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over all layers, at 1 byte an element (times the dtype's)."""
        return 2 * self.num_layers * self.kv_width


def model_size(model_cfg: ModelConfig) -> ModelSize:
    """The :class:`ModelSize` of the ``model`` config group's model (built on ``meta``); with
    ``model.lora.r > 0`` the trainable parameters are the adapters'."""
    from medsrl.models.lora import trainable_params

    model = meta_model(model_cfg)
    lora = model_cfg.lora
    size = size_of(model)
    if not lora.enabled:
        return size
    return replace(size, trainable_params=trainable_params(model, lora),
                   lora_largest_matrix=largest_targeted_matrix(model, lora.target_modules))


def largest_targeted_matrix(model: torch.nn.Module, targets: Any) -> int:
    """Elements of the largest linear weight LoRA adapts in ``model`` (``models/lora.py``
    ``trainable_params``' rule: the ``targets`` names, or every linear layer but the LM head for
    "all-linear"): the weight sync merges one such weight at a time, its delta beside the sum."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def targeted(name: str, module: torch.nn.Module) -> bool:
        if isinstance(targets, str):
            return module is not head
        return name.rsplit(".", 1)[-1] in targets

    return max((m.weight.numel() for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and targeted(name, m)), default=0)


def size_of(model: torch.nn.Module) -> ModelSize:
    """Count ``model``'s parameters per FSDP unit (each decoder layer; the rest) and read its widths."""
    config = model.config
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={layer_names})")
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelSize(
        params=total,
        layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        root_params=root,
        num_layers=len(layers),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        q_width=heads * head_dim,
        kv_width=kv_heads * head_dim,
        largest_param=max(p.numel() for p in model.parameters()),
    )
