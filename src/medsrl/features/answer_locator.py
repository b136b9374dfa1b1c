"""Where the final answer starts in a response: the token holding the ``{`` of the last ``\\boxed{``,
whose hidden states predict the first answer token (MEDS's feature, docs/REFERENCE.md step 1).

The search runs on the tokens' decoded text, because a tokenizer splits ``\\boxed{`` in many ways
(``['Ġ$\\', 'boxed', '{x']``): unlike the reference's backward search of the ids, the last box wins
whatever its split. Without ``\\boxed{`` the first ``{`` after the last ``boxed`` counts if at most
``fallback_window`` tokens later; a merged brace (``'{x'``) is read at its token, as the reference.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from medsrl.reward.answer_span import TokenPieces, answer_start, as_list, token_pieces

BOXED_OPEN = "\\boxed{"
BOXED_WORD = "boxed"
DEFAULT_FALLBACK_WINDOW = 10
_FIRST_WINDOW = 64  # tokens of the first backwards scan (the final box is usually near the end)


def _token_at(ends: list[int], char_index: int) -> int:
    """Index of the token whose span holds ``char_index`` (``ends`` cumulative)."""
    return bisect.bisect_right(ends, char_index)


def _locate(ids: list[int], pieces: TokenPieces, fallback_window: int) -> int | None:
    # 1. Exact: the last "\boxed{", scanning backwards in doubling windows (one found in the text
    # of ids[start:] is the last of the response: a later one would lie in the same suffix).
    window = _FIRST_WINDOW
    while True:
        start = max(0, len(ids) - window)
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
    brace = text.find("{", k + len(BOXED_WORD)) if k >= 0 else -1
    if brace < 0:
        return None
    ends = list(itertools.accumulate(len(p) for p in suffix))
    brace_token = _token_at(ends, brace)
    near = brace_token - _token_at(ends, k + len(BOXED_WORD) - 1) <= fallback_window
    return brace_token if near else None


def _locate_after(ids: list[int], pieces: TokenPieces, fallback_window: int,
                  reasoning_end: str | None) -> int | None:
    """:func:`_locate` after the last ``reasoning_end`` (``None`` when the reasoning never closes)."""
    start = answer_start(ids, pieces, reasoning_end)
    index = None if start is None else _locate(ids[start:], pieces, fallback_window)
    return None if index is None else start + index


def locate_answers(
    batch_response_ids: Sequence[Sequence[int]],
    tokenizer: Any,
    *,
    fallback_window: int = DEFAULT_FALLBACK_WINDOW,
    reasoning_end: str | None = None,
) -> list[int | None]:
    """Per response, the index of the token holding the ``{`` of the last ``\\boxed{`` (None: no
    box); with ``reasoning_end`` only a box after the last such tag counts, as in grading."""
    pieces = token_pieces(tokenizer)
    return [_locate_after(as_list(ids), pieces, fallback_window, reasoning_end) for ids in batch_response_ids]
