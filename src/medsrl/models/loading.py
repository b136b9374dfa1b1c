"""Loading tokenizers and policies: the tiny CPU preset or a real Hugging Face model.

``random_model_like`` builds a small random model of a real architecture, so real tokenizers and
configs can be tested without weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from medsrl.config import DTYPE_NAMES
from medsrl.data.template import ENDOFTEXT, IM_END
from medsrl.models.char_tokenizer import (
    ALPHABET,
    SPECIAL_TOKENS,
    UNK,
    build_char_tokenizer,
    char_vocab,
)
from medsrl.models.tiny import build_tiny_model

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dt) for dt, names in DTYPE_NAMES.items() for name in names}


class ModelLoadError(OSError):
    """A tokenizer or model could not be loaded; the message names the path and what to do."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """Map ``"bfloat16"``/``"bf16"``/``"float32"``/... to a torch dtype (``"auto"`` passes through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        return "auto"
    if key not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[key]


def _looks_local(name_or_path: str) -> bool:
    """True for things that can only be a filesystem path (absolute, ./, ../, ~)."""
    return os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or os.path.exists(name_or_path)


def _check_local(name_or_path: str, what: str) -> str:
    path = os.path.expanduser(name_or_path)
    if _looks_local(name_or_path) and not os.path.isdir(path):
        raise ModelLoadError(
            f"Cannot load {what} from {name_or_path!r}: no such directory. Pass an existing local "
            f"directory (containing config.json and weights / tokenizer files) or a Hugging Face "
            f"model name."
        )
    return path if _looks_local(name_or_path) else name_or_path


def _load_error(name_or_path: str, what: str, err: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"Cannot load {what} from {name_or_path!r}: {type(err).__name__}: {err}\n"
        f"If this is a Hugging Face model name, the hub may not be reachable (offline, or "
        f"HF_HUB_OFFLINE=1 with nothing cached): download it elsewhere and pass the local "
        f"directory instead."
    )


def _plain_char_vocab() -> dict[str, int]:
    """The char vocabulary as saved before its byte-level names (same ids): policies exported
    then still load, with the tokenizer they were saved with."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [UNK] + ALPHABET)}


def is_char_tokenizer_dir(path: str | Path) -> bool:
    """True when ``path`` holds the tiny preset's char tokenizer (its exact vocabulary)."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return False
    try:
        model = json.loads(file.read_text()).get("model", {})
    except (OSError, ValueError):
        return False
    vocab = model.get("vocab")
    # before the byte-level names, the characters were their own names (the same ids)
    return model.get("type") == "WordLevel" and vocab in (char_vocab(), _plain_char_vocab())


def load_tokenizer(
    name_or_path: str | None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The char tokenizer for ``None``/``"char"``, else ``AutoTokenizer`` with left padding and
    a pad token (``<|endoftext|>`` if in the vocabulary, else the eos token, when it has none)."""
    if name_or_path is None or str(name_or_path).strip().lower() == "char":
        return build_char_tokenizer()
    name_or_path = str(name_or_path)
    source = _check_local(name_or_path, "tokenizer")
    # A saved char tokenizer beside a Qwen2 config.json: AutoTokenizer would pick Qwen2Tokenizer,
    # which drops characters outside the alphabet and breaks one saved before the byte-level
    # names (spaces and newlines dropped): load exactly what was saved.
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
            raise ModelLoadError(
                f"Tokenizer {name_or_path!r} has no pad token, no {ENDOFTEXT} and no eos token"
            )
    return tok


def load_policy(
    name_or_path: str | None = None,
    *,
    tiny: Mapping[str, Any] | None = None,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The policy: ``AutoModelForCausalLM`` for a hub name or local directory (``tiny`` ignored),
    else (``None`` or ``"tiny"``) the tiny Qwen2 preset built with the ``tiny`` keyword arguments
    of ``build_tiny_model`` (``seed`` included)."""
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


_ARCHITECTURES = ("qwen2", "qwen3", "llama")


def random_model_like(
    architecture: str,
    vocab_size: int,
    *,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A small randomly initialised model of a real architecture (``qwen2``, ``qwen3``, ``llama``).
    Extra keyword arguments go to the config (e.g. ``tie_word_embeddings=False``)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    arch = architecture.strip().lower()
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=4096,
        tie_word_embeddings=True, rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        cfg_cls, model_cls = Qwen2Config, Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg_cls, model_cls = Qwen3Config, Qwen3ForCausalLM
        common["head_dim"] = hidden_size // num_attention_heads
    elif arch == "llama":
        cfg_cls, model_cls = LlamaConfig, LlamaForCausalLM
    else:
        raise ValueError(
            f"random_model_like: unknown architecture {architecture!r}; use one of {_ARCHITECTURES}"
        )
    common.update(config_overrides)
    config = cfg_cls(**common)
    torch.manual_seed(seed)
    return model_cls(config)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of ``<|im_end|>``, ``<|endoftext|>`` and the eos token that exist (deduplicated, in order)."""
    vocab = tokenizer.get_vocab()
    ids = [int(vocab[token]) for token in (IM_END, ENDOFTEXT) if token in vocab]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))
