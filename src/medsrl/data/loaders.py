"""Read math problem files (.jsonl, .json, .parquet) into :class:`MathExample` lists.

Fields are found automatically for every file under ``shared/data`` or named explicitly with
dotted paths (``reward_model.ground_truth``, ``prompt.0.content``).

Automatic detection, per row, takes the first of these keys that the row has:

- problem: ``problem``, ``question``, ``prompt[0].content`` (a list of chat messages: the first
  ``user`` message). Known instruction suffixes and prefixes (verl's "Let's think step by step
  and output the final answer within \\boxed{}.", Qwen's "Please reason step by step...", DAPO's
  "Answer:" wrapper) are stripped so the stored problem is bare; a ready chat string
  (``<|im_start|>user ...``) is reduced to its user turn.
- answer: ``answer``, ``final_answer``, ``gt_answer``, ``reward_model.ground_truth``, else the last
  ``\\boxed{...}`` of ``solution``. A GSM8K rationale ("... #### 18") gives the number after the
  last ``####``. Lists are joined with ", ", integral floats lose their ".0" (27.0 -> "27").
- solution: ``solution`` when it is a worked solution (a list of solutions gives its first; a
  "solution" that is just the final answer, as in verl files, is dropped). For GSM8K the
  rationale before ``####`` is the solution.

A key that is present decides the field even when its value is empty: such a row is a bad row
(skipped and counted, or raised), it never silently falls back to another field.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from medsrl.data.example import MathExample
from medsrl.reward.extract import extract_last_boxed

__all__ = [
    "DataError",
    "default_name",
    "load_math_file",
    "strip_instructions",
]

log = logging.getLogger(__name__)

PROBLEM_FIELDS = ("problem", "question", "prompt.0.content")
ANSWER_FIELDS = ("answer", "final_answer", "gt_answer", "reward_model.ground_truth")
BOXED_PREFIX = "boxed:"  # answer_field="boxed:solution" -> last \boxed{} of that field

# Instruction text that data sets append to (or put before) the bare problem.
INSTRUCTION_SUFFIXES = (
    "Let's think step by step and output the final answer within \\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{{}}.",
    'Remember to put your answer on its own line after "Answer:".',
)
INSTRUCTION_PREFIXES = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
)

_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_GENERIC_STEMS = {"test", "train", "val", "valid", "validation", "dev", "data"}
_MAX_ROWS_SHOWN = 5


class DataError(ValueError):
    """A data file cannot be read, or one of its rows is unusable. Names the file and row/line."""


class _Missing:
    """Marker for a dotted path that does not exist in a row (distinct from a None value)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


# --------------------------------------------------------------------------------------------
# small text helpers


def strip_instructions(problem: str) -> str:
    """Remove known instruction suffixes/prefixes and surrounding whitespace from a problem."""
    text = problem.strip()
    changed = True
    while changed:
        changed = False
        for suffix in INSTRUCTION_SUFFIXES:
            if text.endswith(suffix):
                text = text[: -len(suffix)].rstrip()
                changed = True
        for prefix in INSTRUCTION_PREFIXES:
            if text.startswith(prefix):
                text = text[len(prefix) :].lstrip()
                changed = True
    return text


def _user_turn(text: str) -> str:
    """The user turn of a ready Qwen chat string; other text unchanged."""
    start = "<|im_start|>user\n"
    i = text.find(start)
    if i < 0:
        return text
    body = text[i + len(start) :]
    end = body.find("<|im_end|>")
    return body if end < 0 else body[:end]


def _format_number(value: float | int) -> str:
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return str(int(value))
        return repr(value)
    return str(value)


def _answer_to_str(value: Any) -> str | None:
    """Gold answer as a string; None for missing/empty."""
    if value is None or value is MISSING:
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return _format_number(value)
    if isinstance(value, str):
        text = value.strip()
        if "####" in text:  # GSM8K rationale: the answer is the number after the last ####
            text = text.rsplit("####", 1)[1].strip()
            if _THOUSANDS.fullmatch(text):  # "1,450,000" -> "1450000" (not a tuple)
                text = text.replace(",", "")
        return text or None
    if isinstance(value, (list, tuple)):
        parts = [_answer_to_str(v) for v in value]
        parts = [p for p in parts if p]
        return ", ".join(parts) or None
    return None


def _solution_to_str(value: Any, answer: str | None) -> str | None:
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if isinstance(v, str) and v.strip()), None)
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    if answer is not None and text == answer:  # verl: "solution" is only the final answer
        return None
    return text


def _get_path(row: Any, path: str) -> Any:
    """Follow a dotted path (``a.b``, ``prompt.0.content``) into dicts and lists."""
    node = row
    for part in path.split("."):
        if isinstance(node, Mapping):
            if part not in node:
                return MISSING
            node = node[part]
        elif isinstance(node, Sequence) and not isinstance(node, str):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                return MISSING
        else:
            return MISSING
    return node


# --------------------------------------------------------------------------------------------
# per-row field resolution


def _auto_problem(row: Mapping[str, Any]) -> tuple[str, Any]:
    for field in ("problem", "question"):
        if field in row:
            return field, row[field]
    messages = row.get("prompt", MISSING)
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        users = [m for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        first = users[0] if users else (messages[0] if len(messages) else None)
        if isinstance(first, Mapping):
            return "prompt[0].content", first.get("content")
    return "problem", MISSING


def _auto_answer(row: Mapping[str, Any]) -> tuple[str, Any]:
    for field in ANSWER_FIELDS:
        value = _get_path(row, field)
        if value is not MISSING:
            return field, value
    if "solution" in row:
        solution = row["solution"]
        if isinstance(solution, (list, tuple)):
            solution = "\n".join(s for s in solution if isinstance(s, str))
        return "\\boxed{} of solution", extract_last_boxed(solution)
    return "answer", MISSING


def _problem_text(value: Any) -> str | None:
    if value is MISSING or value is None:
        return None
    if not isinstance(value, str):
        value = str(value)
    return strip_instructions(_user_turn(value)) or None


# --------------------------------------------------------------------------------------------
# file readers: yield (row_index, line_number_or_None, row)


def _read_jsonl(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    row = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})"
                ) from e
            yield row, lineno, obj
            row += 1


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _read_json(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # some ".json" files are really JSON Lines
        first_line = text.lstrip().split("\n", 1)[0]
        if e.lineno > 1 and first_line.startswith("{") and _parses(first_line):
            yield from _read_jsonl(path)
            return
        raise DataError(
            f"{path}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})"
        ) from e
    if isinstance(data, Mapping):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, obj in enumerate(data):
        yield i, None, obj


def _read_parquet(
    path: Path, columns: set[str] | None = None
) -> Iterator[tuple[int, int | None, Any]]:
    try:
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        keep = [n for n in names if columns is None or n in columns]
        table = pq.read_table(path, columns=keep)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet file: {e}") from e
    for i, obj in enumerate(table.to_pylist()):
        yield i, None, obj


_READERS: dict[str, Callable[..., Iterator[tuple[int, int | None, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def _columns_needed(problem_field: str | None, answer_field: str | None) -> set[str]:
    """Top-level columns the field mapping can touch (parquet reads only these: much faster)."""
    fields = [problem_field or "", answer_field or ""]
    cols = {"solution"}
    if problem_field is None:
        cols |= {"problem", "question", "prompt"}
    if answer_field is None:
        cols |= {f.split(".")[0] for f in ANSWER_FIELDS}
    for f in fields:
        if f:
            cols.add(f.removeprefix(BOXED_PREFIX).split(".")[0])
    return cols


def default_name(path: str | Path) -> str:
    """The file's stem, or its folder's name when the stem is generic (``test``, ``train``):
    the name of a dataset or benchmark read from the file when none is given."""
    path = Path(path)
    if path.stem.lower() in _GENERIC_STEMS and path.parent.name:
        return path.parent.name
    return path.stem


def _no_examples(path: Path, total: int, bad_rows: list[int], bad_reasons: list[str]) -> DataError:
    """The error for a file that gives no problem at all: empty, or every row unusable. A run
    or benchmark built on it would fail later and far from the file (or score nothing)."""
    if total == 0:
        return DataError(f"{path}: the file holds no rows (empty)")
    return DataError(
        f"{path}: none of its {total} rows is usable (missing or empty problem/answer; "
        f"first: row {bad_rows[0]}: {bad_reasons[0]})"
    )


def _where(path: Path, row: int, lineno: int | None) -> str:
    return f"{path}: row {row}" + (f" (line {lineno})" if lineno is not None else "")


# --------------------------------------------------------------------------------------------


def load_math_file(
    path: str | Path,
    *,
    name: str | None = None,
    problem_field: str | None = None,
    answer_field: str | None = None,
    limit: int | None = None,
    on_bad_row: str = "skip",
) -> list[MathExample]:
    """Read a .jsonl / .json (list of objects) / .parquet file of math problems.

    Args:
        path: the file.
        name: dataset name stored in ``MathExample.source``; default from the path
            (``math500/test.jsonl`` -> ``math500``, ``deepscaler_eval/aime.json`` -> ``aime``).
        problem_field: dotted path of the problem (``prompt.0.content``); default: auto-detect.
        answer_field: dotted path of the answer (``reward_model.ground_truth``), or
            ``boxed:<path>`` for the last ``\\boxed{}`` of a field; default: auto-detect.
        limit: keep at most this many examples (the first ones); rows after are not read.
            ``0`` gives an empty list.
        on_bad_row: ``"skip"`` (count them, log one warning) or ``"raise"`` (:class:`DataError`)
            for rows whose problem or answer is missing or empty.

    Raises:
        DataError: the file is missing, cannot be parsed (names the line), has an unknown
            extension, gives no usable row at all (empty, or every row bad), or (with
            ``on_bad_row="raise"``) a row is unusable (names the row).
    """
    if on_bad_row not in ("skip", "raise"):
        raise ValueError(f"on_bad_row must be 'skip' or 'raise', got {on_bad_row!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unknown file extension {path.suffix!r} (expected one of {sorted(_READERS)})"
        )
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    source = name if name is not None else default_name(path)

    examples: list[MathExample] = []
    bad_rows: list[int] = []
    bad_reasons: list[str] = []
    total = 0
    rows = (
        _read_parquet(path, _columns_needed(problem_field, answer_field))
        if reader is _read_parquet
        else reader(path)
    )
    for row, lineno, obj in rows:
        if limit is not None and len(examples) >= limit:
            break
        total += 1
        reason = None
        problem = answer = solution = None
        if not isinstance(obj, Mapping):
            reason = f"expected an object, got {type(obj).__name__}"
        else:
            if problem_field is not None:
                p_name, p_value = problem_field, _get_path(obj, problem_field)
            else:
                p_name, p_value = _auto_problem(obj)
            problem = _problem_text(p_value)

            if answer_field is not None and answer_field.startswith(BOXED_PREFIX):
                a_path = answer_field[len(BOXED_PREFIX) :]
                a_name, a_value = answer_field, extract_last_boxed(_get_path(obj, a_path))
            elif answer_field is not None:
                a_name, a_value = answer_field, _get_path(obj, answer_field)
            else:
                a_name, a_value = _auto_answer(obj)
            answer = _answer_to_str(a_value)

            if problem is None:
                what = "missing" if p_value is MISSING else "empty"
                reason = f"{what} problem (field {p_name!r})"
            elif answer is None:
                what = "missing" if a_value is MISSING else "empty"
                reason = f"{what} answer (field {a_name!r})"
            else:
                raw_solution = obj.get("solution")
                if isinstance(a_value, str) and "####" in a_value and raw_solution is None:
                    raw_solution = a_value.rsplit("####", 1)[0]
                solution = _solution_to_str(raw_solution, answer)

        if reason is not None:
            if on_bad_row == "raise":
                raise DataError(f"{_where(path, row, lineno)}: {reason}")
            bad_rows.append(row)
            bad_reasons.append(reason)
            continue
        assert problem is not None and answer is not None
        examples.append(MathExample.make(problem, answer, source, row, solution))

    if bad_rows:
        shown = ", ".join(str(r) for r in bad_rows[:_MAX_ROWS_SHOWN])
        more = ", ..." if len(bad_rows) > _MAX_ROWS_SHOWN else ""
        log.warning(
            "%s: skipped %d of %d rows with a missing or empty problem/answer (rows %s%s; first: %s)",
            path,
            len(bad_rows),
            total,
            shown,
            more,
            bad_reasons[0],
        )
    if not examples and limit != 0:
        raise _no_examples(path, total, bad_rows, bad_reasons)
    return examples
