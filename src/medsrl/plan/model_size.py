"""The sizes the memory plan needs, read from the model itself built on the ``meta`` device.

No formula per architecture: the parameters are counted where FSDP would put them, each decoder
layer (``_no_split_modules``) one unit, the rest the root unit. Real models come from
``model.shape`` or a local ``name_or_path``'s config.json, which wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
        """Those with gradients and AdamW states."""
        return self.params if self.trainable_params is None else self.trainable_params

    @property
    def lora(self) -> bool:
        return self.trainable_params is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over all layers, at 1 byte an element (times the dtype's)."""
        return 2 * self.num_layers * self.kv_width


def model_size(model_cfg: ModelConfig) -> ModelSize:
    """With ``model.lora.r > 0`` the trainable parameters are the adapters'."""
    from medsrl.models.lora import targeted_linears, trainable_params

    model = meta_model(model_cfg)
    lora = model_cfg.lora
    size = size_of(model)
    if not lora.enabled:
        return size
    # the weight sync merges one adapted weight at a time, its delta beside the sum
    largest = max((m.weight.numel() for m in targeted_linears(model, lora.target_modules)), default=0)
    return replace(size, trainable_params=trainable_params(model, lora), lora_largest_matrix=largest)


def size_of(model: torch.nn.Module) -> ModelSize:
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
