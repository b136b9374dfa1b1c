"""Find the final answer in a model response: the content of its last ``\\boxed{...}`` (models
box intermediate results too). Braces are parsed by hand (regexes cannot nest); a box never
closed, as in a response truncated at the length limit, gives ``None``: no answer, no credit."""

from __future__ import annotations

import re

# `\boxed` or `\fbox` not followed by another letter (so `\boxedx` is not a box), and the
# whitespace after it: `\boxed {5}` is still a braced box, `\boxed 5` the space form.
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])(?P<space>[ \t]*)")
# A brace, or an escape (`\{`, `\}`, `\\`): escapes are skipped, not structure.
_BRACE_OR_ESCAPE = re.compile(r"\\.|[{}]", re.DOTALL)


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (also ``\\fbox{...}`` and ``\\boxed 5``); ``None`` if
    there is no box or the last one is unbalanced."""
    matches = list(_BOX_COMMAND.finditer(text))
    if not matches:
        return None
    pos = matches[-1].end()
    if text.startswith("{", pos):
        end = _matching_brace(text, pos)
        return None if end is None else text[pos + 1 : end]
    if not matches[-1]["space"]:
        return None
    # Space form `\boxed 5`: the argument runs to the closing `$` or the end of the line.
    return re.split(r"[$\n]", text[pos:], maxsplit=1)[0].rstrip() or None


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_index``; escaped ``\\{ \\}`` are skipped."""
    depth = 0
    for token in _BRACE_OR_ESCAPE.finditer(text, open_index):
        if token[0] == "{":
            depth += 1
        elif token[0] == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return None
