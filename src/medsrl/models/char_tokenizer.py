"""A character-level tokenizer with the Qwen special tokens, for the tiny CPU preset.

Built with the ``tokenizers`` library and wrapped as a ``PreTrainedTokenizerFast`` so it is saved
and loaded exactly like a Hugging Face tokenizer (``save_pretrained`` / ``AutoTokenizer``).
Every printable ASCII character is one token; the Qwen chat tokens are single special tokens.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from medsrl.data.template import ENDOFTEXT, IM_END, IM_START

SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
UNK = "<unk>"
ALPHABET = sorted(set(string.printable) - set("\r\x0b\x0c"))


def char_vocab() -> dict[str, int]:
    """Fixed vocabulary: special tokens first (ids 0-2), then ``<unk>``, then characters."""
    tokens = SPECIAL_TOKENS + [UNK] + ALPHABET
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return the char tokenizer: pad = ``<|endoftext|>``, eos = ``<|im_end|>``."""
    vocab = char_vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        pad_token=ENDOFTEXT,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    return tok
