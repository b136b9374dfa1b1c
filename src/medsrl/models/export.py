"""Saving a policy the Hugging Face way (final export, bf16 milestones): a plain model as it is or
cast to ``dtype``, a LoRA policy merged or as the adapter alone (``models/lora.py``)."""

from __future__ import annotations

import torch
from torch import nn

from medsrl.models import lora


def save_policy(policy: nn.Module, tokenizer, path, *, dtype: torch.dtype | None = None,
                merge_on_export: bool = True) -> None:
    """Write ``policy`` (all its weights on this process) and ``tokenizer`` to ``path``."""
    model, state = lora.export_view(policy, merge_on_export)
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
