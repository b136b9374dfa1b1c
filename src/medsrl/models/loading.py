"""Loading tokenizers and policies: the tiny CPU preset, a real Hugging Face model, or a small
random model of a real architecture (real tokenizers and configs tested without weights)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from medsrl.data.template import ENDOFTEXT, IM_END
from medsrl.models.char_tokenizer import ALPHABET, SPECIAL_TOKENS, UNK, build_char_tokenizer, char_vocab
from medsrl.models.settings import DTYPE_NAMES
from medsrl.models.tiny import build_tiny_model

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dt) for dt, names in DTYPE_NAMES.items() for name in names}


class ModelLoadError(OSError):
    """A tokenizer or model could not be loaded; the message names the path and what to do."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A dtype setting's torch dtype (``"auto"`` passes through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        return "auto"
    if key not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[key]


def _check_local(name_or_path: str, what: str) -> str:
    """A hub name as it is; what can only be a path expanded, and refused unless it is a directory."""
    local = name_or_path.startswith((".", "~")) or os.path.isabs(name_or_path)
    if not (local or os.path.exists(name_or_path)):
        return name_or_path
    path = os.path.expanduser(name_or_path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"Cannot load {what} from {name_or_path!r}: no such directory. Pass an existing local "
                             "directory (containing config.json and weights / tokenizer files) or a Hugging Face "
                             "model name.")
    return path


def _load_error(name_or_path: str, what: str, err: Exception) -> ModelLoadError:
    return ModelLoadError(f"Cannot load {what} from {name_or_path!r}: {type(err).__name__}: {err}\n"
                          "If this is a Hugging Face model name, the hub may not be reachable (offline, or "
                          "HF_HUB_OFFLINE=1 with nothing cached): download it elsewhere and pass the local "
                          "directory instead.")


def is_char_tokenizer_dir(path: str | Path) -> bool:
    try:
        model = json.loads((Path(path) / "tokenizer.json").read_text()).get("model", {})
    except (OSError, ValueError):
        return False
    # as saved before the byte-level names, the characters were their own names (the same ids):
    # policies exported then still load, with the tokenizer they were saved with
    plain = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [UNK] + ALPHABET)}
    return model.get("type") == "WordLevel" and model.get("vocab") in (char_vocab(), plain)


def load_tokenizer(name_or_path: str | None, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The char tokenizer for ``None``/``"char"``, else ``AutoTokenizer`` with left padding and
    a pad token (``<|endoftext|>`` if in the vocabulary, else the eos token, when it has none)."""
    if name_or_path is None or str(name_or_path).strip().lower() == "char":
        return build_char_tokenizer()
    name_or_path = str(name_or_path)
    source = _check_local(name_or_path, "tokenizer")
    # a saved char tokenizer beside a Qwen2 config.json: AutoTokenizer would pick Qwen2Tokenizer,
    # which drops characters outside the alphabet: load exactly what was saved
    cls = PreTrainedTokenizerFast if is_char_tokenizer_dir(source) else AutoTokenizer
    try:
        tok = cls.from_pretrained(source, padding_side="left", trust_remote_code=trust_remote_code)
    except Exception as err:  # OSError, ValueError (bad repo id), EnvironmentError, ...
        raise _load_error(name_or_path, "tokenizer", err) from err
    tok.padding_side = "left"
    if tok.pad_token is None:
        if ENDOFTEXT in tok.get_vocab():
            tok.pad_token = ENDOFTEXT
        elif tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        else:
            raise ModelLoadError(f"Tokenizer {name_or_path!r} has no pad token, no {ENDOFTEXT} and no eos token")
    return tok


def load_policy(name_or_path: str | None = None, *, tiny: Mapping[str, Any] | None = None,
                dtype: str | torch.dtype = "float32", attn_implementation: str | None = None,
                trust_remote_code: bool = False) -> PreTrainedModel:
    """``AutoModelForCausalLM`` for a hub name or local directory, else the tiny preset."""
    torch_dtype = resolve_dtype(dtype)
    if name_or_path is None or str(name_or_path).strip().lower() == "tiny":
        model = build_tiny_model(**dict(tiny or {}))
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
        return model

    name_or_path = str(name_or_path)
    source = _check_local(name_or_path, "model")
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except Exception as err:
        raise _load_error(name_or_path, "model", err) from err


_ARCHITECTURES = ("qwen2", "qwen3", "llama")  # model types that AutoConfig knows


def random_model_like(architecture: str, vocab_size: int, *, num_hidden_layers: int = 2, hidden_size: int = 64,
                      num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
                      seed: int = 0, **config_overrides: Any) -> PreTrainedModel:
    """A small randomly initialised model of a real architecture; extra keyword arguments go to the config."""
    arch = architecture.strip().lower()
    if arch not in _ARCHITECTURES:
        raise ValueError(f"random_model_like: unknown architecture {architecture!r}; use one of {_ARCHITECTURES}")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=4096,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    )
    if arch == "qwen3":
        common["head_dim"] = hidden_size // num_attention_heads
    common.update(config_overrides)
    config = AutoConfig.for_model(arch, **common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of ``<|im_end|>``, ``<|endoftext|>`` and the eos token that exist."""
    vocab = tokenizer.get_vocab()
    ids = [int(vocab[token]) for token in (IM_END, ENDOFTEXT) if token in vocab]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))
