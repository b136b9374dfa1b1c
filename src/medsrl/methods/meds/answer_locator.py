"""Where the final answer starts in a response: the token holding the ``{`` of the last ``\\boxed{``.

MEDS reads its feature at that position (PAPER.md step 1): the hidden states of the ``{`` token
predict the first answer token, which sits at ``position + 1``.

The search works on the *text* of the tokens, not on one fixed token sequence, because a
tokenizer splits ``\\boxed{`` in many ways. With the Qwen2.5 byte-level BPE, for example::

    "\\boxed{025}"        -> ['\\', 'boxed', '{', '0', '2', '5', '}']
    "$\\boxed{\\frac12}$" -> ['Ġ$\\', 'boxed', '{\\', 'frac', ...]    (backslash merged left,
                                                                       brace merged right)
    "{\\boxed{5}}"        -> ['{\\', 'boxed', '{', '5', '}}']
    "\\(\\boxed{x=3}\\)"  -> ['Ġ\\', '(\\', 'boxed', '{x', '=', ...]

Every token id is decoded on its own to a text piece (cached per id); the pieces, joined, give
the response text with a known character span per token. The ``{`` that follows the last
``\\boxed`` in that text is mapped back to the token that holds it.

Reference behaviour kept on purpose:

* **Last box wins.** Only the last ``\\boxed{`` counts (the graded answer is the last box).
  The reference searches the *token ids* of ``\\boxed{`` backwards; when the final box is split
  differently from its token sequence it can land on an earlier box or on the fallback. The text
  search here always finds the final ``\\boxed{`` whatever the split (a strict superset of the
  exact-sequence match on the common splits).
* **Fallback.** With no ``\\boxed{`` in the text (e.g. ``\\boxed {7}``), take the last
  occurrence of ``boxed`` and the first ``{`` after it, provided the token holding that ``{`` is
  at most ``fallback_window`` tokens after the token that ends ``boxed``. Otherwise ``None``: the
  response gets no feature, no memory entry and no penalty.
* **Merged braces.** When BPE merges the ``{`` with what follows (``'{x'``, ``'{\\'``), the
  located token also holds the start of the answer; the feature is still read at this token and
  scores the token at ``position + 1`` (``'='`` in ``'{x', '='``, ``'frac'`` in ``'{\\', 'frac'``),
  exactly as the reference does.
* **Unbalanced / truncated boxes** (``\\boxed{12`` with no ``}``) are located like any other.
  When the ``{`` is the very last response token there is no ``position + 1`` token; the caller
  (:func:`medsrl.methods.meds.logit_capture.answer_targets`) then drops the response.

Per-id decoding: ``tokenizer.decode([id])`` with special tokens kept. For byte-level BPE every
ASCII character survives exactly (``\\``, ``boxed`` and ``{`` are ASCII); a multi-byte character
split across tokens decodes to replacement characters, which only shifts spans *within* the
tokens that hold it and never creates or hides a ``\\boxed{``.
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
# The backwards scan starts with this many tokens and doubles until it finds a box or covers the
# whole response (the final box is usually within the last few dozen tokens).
_FIRST_WINDOW = 64


def _token_at(ends: list[int], char_index: int) -> int:
    """Index of the token whose span ``[start, end)`` holds ``char_index`` (``ends`` cumulative)."""
    return bisect.bisect_right(ends, char_index)


def _locate(ids: list[int], pieces: TokenPieces, fallback_window: int) -> int | None:
    n = len(ids)
    if n == 0:
        return None
    # 1. Exact: the last "\boxed{" in the text, scanning backwards in doubling windows. An
    # occurrence found in the text of ids[start:] is the last one of the whole response: any later
    # occurrence would start later, hence inside the same suffix.
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
    """:func:`_locate` within the answer span (``reward/answer_span.py``): the box after the
    last ``reasoning_end``; ``None`` when the reasoning never closes."""
    start = answer_start(ids, pieces, reasoning_end)
    if start is None:
        return None
    if start == 0:
        return _locate(ids, pieces, fallback_window)
    index = _locate(ids[start:], pieces, fallback_window)
    return None if index is None else start + index


def locate_answer(
    response_ids: Sequence[int],
    tokenizer: Any,
    *,
    fallback_window: int = DEFAULT_FALLBACK_WINDOW,
    reasoning_end: str | None = None,
) -> int | None:
    """Index within ``response_ids`` of the token holding the ``{`` of the last ``\\boxed{``.

    ``None`` when the response has no box (see the module docstring for the fallback). The first
    answer token, whose logit is the MEDS feature, is ``response_ids[index + 1]``.
    ``reasoning_end`` (``grader.reasoning_end``): only a box after the last such tag counts, as
    in grading; a response without the tag has no answer.
    """
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
