"""Where the final answer starts in a response: the token holding the ``{`` of the last ``\\boxed{``.

MEDS reads its feature there (PAPER.md step 1): that token's hidden states predict the first
answer token, at ``position + 1``. The search runs on the *text* of the tokens, because a
tokenizer splits ``\\boxed{`` in many ways (Qwen2.5 byte-level BPE)::

    "\\boxed{025}"        -> ['\\', 'boxed', '{', '0', '2', '5', '}']
    "$\\boxed{\\frac12}$" -> ['Ġ$\\', 'boxed', '{\\', 'frac', ...]
    "\\(\\boxed{x=3}\\)"  -> ['Ġ\\', '(\\', 'boxed', '{x', '=', ...]

Each id is decoded on its own (``decode([id])``, special tokens kept, cached per id), which
gives every token a character span; the ``{`` after the last ``\\boxed`` maps back to its token.
Byte-level BPE keeps every ASCII character exact; a multi-byte character split across tokens
only shifts spans within its own tokens. Behaviour, against the reference:

* **Last box wins**, whatever its split (the reference searches the token ids of ``\\boxed{``
  backwards and can land on an earlier box when the final one is split differently).
* **Fallback** without ``\\boxed{`` (e.g. ``\\boxed {7}``): the first ``{`` after the last
  ``boxed``, if its token is at most ``fallback_window`` tokens later; else ``None`` (no feature,
  no memory entry, no penalty).
* **Merged braces** (``'{x'``, ``'{\\'``): the feature is still read at this token and scores
  the token after it, as the reference does.
* **Unclosed boxes** are located like any other; a ``{`` that is the last token has nothing
  to score and :func:`medsrl.methods.meds.logit_capture.answer_targets` drops it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from medsrl.reward.answer_span import TokenPieces, answer_start, as_list, token_pieces

__all__ = ["TokenPieces", "locate_answer", "locate_answers", "token_pieces"]

BOXED_OPEN = "\\boxed{"
BOXED_WORD = "boxed"
DEFAULT_FALLBACK_WINDOW = 10
_FIRST_WINDOW = 64  # tokens of the first backwards scan (the final box is usually near the end)


def _token_at(ends: list[int], char_index: int) -> int:
    """Index of the token whose span ``[start, end)`` holds ``char_index`` (``ends`` cumulative)."""
    return bisect.bisect_right(ends, char_index)


def _locate(ids: list[int], pieces: TokenPieces, fallback_window: int) -> int | None:
    n = len(ids)
    if n == 0:
        return None
    # 1. Exact: the last "\boxed{", scanning backwards in doubling windows (one found in the text
    # of ids[start:] is the last of the response: a later one would lie in the same suffix).
    window = _FIRST_WINDOW
    while True:
        start = max(0, n - window)
        suffix = pieces.pieces(ids[start:])
        text = "".join(suffix)
        k = text.rfind(BOXED_OPEN)
        if k >= 0:
            ends = list(itertools.accumulate(len(p) for p in suffix))
            return start + _token_at(ends, k + len(BOXED_OPEN) - 1)
        if start == 0:
            break
        window *= 2
    # 2. Fallback on the whole text: last "boxed", then the first "{" after it, within the window.
    k = text.rfind(BOXED_WORD)
    if k < 0:
        return None
    brace = text.find("{", k + len(BOXED_WORD))
    if brace < 0:
        return None
    ends = list(itertools.accumulate(len(p) for p in suffix))
    boxed_token = _token_at(ends, k + len(BOXED_WORD) - 1)
    brace_token = _token_at(ends, brace)
    if brace_token - boxed_token > fallback_window:
        return None
    return brace_token


def _locate_after(ids: list[int], pieces: TokenPieces, fallback_window: int,
                  reasoning_end: str | None) -> int | None:
    """:func:`_locate` after the last ``reasoning_end`` (``None`` when the reasoning never closes)."""
    start = answer_start(ids, pieces, reasoning_end)
    if start is None:
        return None
    index = _locate(ids[start:], pieces, fallback_window)
    return None if index is None else start + index


def locate_answer(
    response_ids: Sequence[int],
    tokenizer: Any,
    *,
    fallback_window: int = DEFAULT_FALLBACK_WINDOW,
    reasoning_end: str | None = None,
) -> int | None:
    """Index within ``response_ids`` of the token holding the ``{`` of the last ``\\boxed{``
    (``None``: no box), so the first answer token is ``response_ids[index + 1]``. With
    ``reasoning_end`` only a box after the last such tag counts, as in grading."""
    return _locate_after(as_list(response_ids), token_pieces(tokenizer), fallback_window, reasoning_end)


def locate_answers(
    batch_response_ids: Sequence[Sequence[int]],
    tokenizer: Any,
    *,
    fallback_window: int = DEFAULT_FALLBACK_WINDOW,
    reasoning_end: str | None = None,
) -> list[int | None]:
    """:func:`locate_answer` for every response of a batch (pieces cached across the batch)."""
    pieces = token_pieces(tokenizer)
    return [_locate_after(as_list(ids), pieces, fallback_window, reasoning_end) for ids in batch_response_ids]
