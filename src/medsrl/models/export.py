"""Saving a policy the Hugging Face way (final export, bf16 milestones): a plain model as it is or
cast to ``dtype``, a LoRA policy merged or as the adapter alone (``models/lora.py``)."""

from __future__ import annotations

import torch
from torch import nn

from medsrl.models import lora


def save_policy(policy: nn.Module, tokenizer, path, *, dtype: torch.dtype | None = None,
                merge_on_export: bool = True, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``policy`` and ``tokenizer`` to ``path``. ``state``: a sharded policy's weights already
    gathered (``host_weights``): merged, or a LoRA policy's adapters when not merged."""
    if state is not None and not (lora.is_lora(policy) and not merge_on_export):
        model, state = plain_model(policy, state), None  # a plain model of the base architecture
    else:
        model, own = lora.export_view(policy, merge_on_export)
        state = state if state is not None else own
    if dtype is None:
        model.save_pretrained(path, state_dict=state)
    else:
        state = {k: v.to(dtype) for k, v in (state or model.state_dict()).items()}
        was = model.config.dtype
        try:
            model.save_pretrained(path, state_dict=state)
            if not lora.is_lora(model):  # an adapter directory has no config.json
                model.config.dtype = dtype  # save_pretrained writes the parameters' dtype
                model.config.save_pretrained(path)
        finally:
            model.config.dtype = was
    tokenizer.save_pretrained(path)


def plain_model(policy: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Holding ``state``'s tensors, not copies."""
    from transformers import AutoModelForCausalLM

    config = lora.unwrap_peft(policy).config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model
