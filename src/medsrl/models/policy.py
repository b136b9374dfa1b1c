"""Build the policy and tokenizer a run trains, from the ``model`` config group."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from medsrl.models.loading import load_policy, load_tokenizer

log = logging.getLogger(__name__)


def build_policy(model_cfg: dict[str, Any], cache_dir: str | Path):
    """Return ``(policy, tokenizer)``.

    ``name_or_path`` set: a Hugging Face model (name or local directory). Otherwise the tiny
    preset, warm-started on the arithmetic generator first when ``warm_start`` is set (cached
    under ``cache_dir``, rebuilt when its config changes).
    """
    cfg = dict(model_cfg)
    name = cfg.get("name_or_path")
    dtype = cfg.get("dtype", "float32")
    attn = cfg.get("attn_implementation")
    if name is None and cfg.get("warm_start"):
        from medsrl.models.warmstart import WarmStartConfig, ensure_warm_start

        ws = WarmStartConfig(**dict(cfg["warm_start"]))
        name = str(ensure_warm_start(cache_dir, dict(cfg.get("tiny") or {}), ws))
        log.info("tiny preset: warm-started policy at %s", name)
        tok_name = name
    else:
        tok_name = cfg.get("tokenizer") or name
    tokenizer = load_tokenizer(tok_name)
    policy = load_policy(
        name,
        tiny=dict(cfg.get("tiny") or {}),
        dtype=dtype,
        attn_implementation=attn,
        trust_remote_code=bool(cfg.get("trust_remote_code", False)),
    )
    if cfg.get("gradient_checkpointing"):
        policy.gradient_checkpointing_enable()
        policy.config.use_cache = False
    return policy, tokenizer
