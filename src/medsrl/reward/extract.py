"""Find the final answer in a model response: the content of its last ``\\boxed{...}``.

Only the *last* box counts (models box intermediate results too). Braces are parsed by hand
(regexes cannot nest); a box never closed, as in a response truncated at the length limit, gives
``None``: no final answer, no credit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# `\boxed` or `\fbox` not followed by another letter (so `\boxedx` is not a box).
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


@dataclass(frozen=True)
class BoxedSpan:
    """Where the last box sits in the response (character offsets into the text)."""

    content: str
    start: int  # index of the backslash of `\boxed`
    brace: int | None  # index of `{`, or None for the space form
    content_start: int
    content_end: int  # exclusive; the closing `}` (if any) is at content_end


def find_last_boxed(text: str) -> BoxedSpan | None:
    """Locate the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 5``; ``None`` if none or unbalanced."""
    matches = list(_BOX_COMMAND.finditer(text))
    if not matches:
        return None
    match = matches[-1]
    pos = match.end()
    # Skip whitespace between the command and its argument: `\boxed {5}` is still a braced box.
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos < len(text) and text[pos] == "{":
        end = _matching_brace(text, pos)
        if end is None:
            return None
        return BoxedSpan(text[pos + 1 : end], match.start(), pos, pos + 1, end)
    if pos > match.end():
        # Space form `\boxed 5`: the argument runs to the closing `$` or the end of the line.
        stop = len(text)
        for terminator in ("$", "\n"):
            found = text.find(terminator, pos)
            if found != -1:
                stop = min(stop, found)
        content = text[pos:stop].rstrip()
        if not content:
            return None
        return BoxedSpan(content, match.start(), None, pos, pos + len(content))
    return None


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (also ``\\fbox{...}`` and ``\\boxed 5``); ``None`` if
    there is no box or the last one is unbalanced."""
    span = find_last_boxed(text)
    return None if span is None else span.content


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_index``; escaped ``\\{ \\}`` are skipped."""
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # `\{`, `\}` and `\\` are escapes, not structure
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None
