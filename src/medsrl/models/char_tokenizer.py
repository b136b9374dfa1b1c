"""A character-level tokenizer with the Qwen special tokens, for the tiny CPU preset: every printable
ASCII character one token, named in GPT-2's byte-level alphabet so ``AutoTokenizer`` on a saved policy
gives the same ids (the policy works outside medsrl too)."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from medsrl.data.template import ENDOFTEXT, IM_END, IM_START

SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
UNK = "<unk>"
ALPHABET = sorted(set(string.printable) - set("\r\x0b\x0c"))
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def char_vocab() -> dict[str, int]:
    """Special tokens first (ids 0-2), then ``<unk>``, then characters by their byte-level names."""
    names = [_BYTE_LEVEL.pre_tokenize_str(c)[0][0] for c in ALPHABET]  # " " -> "Ġ"; "a" -> "a"
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [UNK] + names)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """pad = ``<|endoftext|>``, eos = ``<|im_end|>``."""
    core = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    # one pre-token per character, renamed into the byte-level alphabet (a non-ASCII character
    # becomes a multi-symbol name, absent from the vocabulary: one <unk>)
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(pattern="", behavior="isolated"), _BYTE_LEVEL])
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        pad_token=ENDOFTEXT,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
