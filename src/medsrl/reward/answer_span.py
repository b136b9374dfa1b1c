"""The part of a response that holds its answer: all of it, or what follows its reasoning.

Reasoning models answer after ``</think>``; a ``\\boxed{}`` inside the reasoning is a guess on the
way. MEDS's answer locator and R3's ranking find the same span in tokens, on per-id text pieces: a
tag that is not a special token spans several tokens, and BPE may merge its ``>`` with a newline.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

THINK_END = "</think>"


def answer_text(response: str, reasoning_end: str | None) -> str | None:
    """The text the grader reads: ``response`` itself (``reasoning_end`` None), else what follows
    the last ``reasoning_end``; ``None`` when the reasoning never closes."""
    if reasoning_end is None:
        return response
    at = response.rfind(reasoning_end)
    return None if at < 0 else response[at + len(reasoning_end):]


class TokenPieces:
    """Per-id text pieces of one tokenizer, decoded lazily and cached (special tokens kept)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def pieces(self, ids: Sequence[int]) -> list[str]:
        cache = self._cache  # looked up inline: this runs per token of every response
        return [cache[i] if i in cache else self._decode(i) for i in ids]

    def _decode(self, token_id: int) -> str:
        self._cache[token_id] = piece = self._tokenizer.decode(
            [int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return piece


_PIECES: weakref.WeakKeyDictionary[Any, TokenPieces] = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Any) -> TokenPieces:
    """The shared :class:`TokenPieces` cache of ``tokenizer`` (one per tokenizer object)."""
    try:
        return _PIECES.setdefault(tokenizer, TokenPieces(tokenizer))
    except TypeError:  # not weak-referenceable: no sharing, still correct
        return TokenPieces(tokenizer)


def as_list(ids: Sequence[int]) -> list[int]:
    if hasattr(ids, "tolist"):  # torch / numpy
        return ids.tolist()
    return ids if isinstance(ids, list) else list(ids)


def answer_start(ids: Sequence[int], pieces: TokenPieces, reasoning_end: str | None) -> int | None:
    """Index of the first answer token of one response: 0 without ``reasoning_end``, else the
    first token holding text after the last tag (a token holding both counts); ``len(ids)`` when
    nothing follows, ``None`` when the tag never appears."""
    if reasoning_end is None:
        return 0
    parts = pieces.pieces(as_list(ids))
    text = "".join(parts)
    at = text.rfind(reasoning_end)
    if at < 0:
        return None
    ends = list(itertools.accumulate(len(p) for p in parts))
    last_char = at + len(reasoning_end) - 1
    holder = bisect.bisect_right(ends, last_char)  # the token holding the tag's last character
    return holder if ends[holder] > last_char + 1 else holder + 1


def answer_starts(batch_ids: Sequence[Sequence[int]], tokenizer: Any, reasoning_end: str | None) -> list[int | None]:
    """:func:`answer_start` for every response of a batch (pieces cached across the batch)."""
    pieces = token_pieces(tokenizer)
    return [answer_start(ids, pieces, reasoning_end) for ids in batch_ids]
