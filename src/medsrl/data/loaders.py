"""Read math problem files (.jsonl, .json, .parquet) or hub data sets into :class:`MathExample` lists.

Fields are dotted paths (``reward_model.ground_truth``, ``prompt.0.content``) or the first key a row
has: the problem from ``problem``, ``question`` or the first user message of ``prompt``, less known
instruction text; the answer from ``ANSWER_FIELDS``, else the last ``\\boxed{}`` of ``solution``, or
the number after a GSM8K rationale's last ``####``. A key that is present decides its field even
when empty: such a row is bad (skipped and counted, or raised), it never falls back to another.
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

__all__ = ["DataError", "default_name", "load_math_file", "load_math_hub", "strip_instructions"]

log = logging.getLogger(__name__)

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
_FILE_BUILDERS = ("parquet", "json", "csv", "arrow", "text")  # datasets' builders of local files


class DataError(ValueError):
    """A data file cannot be read, or one of its rows is unusable. Names the file and row/line."""


MISSING: Any = object()  # a dotted path that does not exist in a row (not a None value)
Rows = Iterator[tuple[int, int | None, Any]]  # (row index, line number or None, row)


def strip_instructions(problem: str) -> str:
    text, previous = problem.strip(), None
    while text != previous:
        previous = text
        for suffix in INSTRUCTION_SUFFIXES:
            text = text.removesuffix(suffix).rstrip()
        for prefix in INSTRUCTION_PREFIXES:
            text = text.removeprefix(prefix).lstrip()
    return text


def _answer_to_str(value: Any) -> str | None:
    if value is None or value is MISSING:
        return None
    if isinstance(value, float):
        return str(int(value)) if math.isfinite(value) and value.is_integer() else repr(value)
    if isinstance(value, int):  # a bool too: "True"
        return str(value)
    if isinstance(value, str):
        text = value.strip()
        if "####" in text:  # GSM8K rationale: the answer is the number after the last ####
            text = text.rsplit("####", 1)[1].strip()
            if _THOUSANDS.fullmatch(text):  # "1,450,000" -> "1450000" (not a tuple)
                text = text.replace(",", "")
        return text or None
    if isinstance(value, (list, tuple)):
        return ", ".join(p for p in map(_answer_to_str, value) if p) or None
    return None


def _solution_to_str(value: Any, answer: str | None) -> str | None:
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if isinstance(v, str) and v.strip()), None)
    text = value.strip() if isinstance(value, str) else ""
    return text if text and text != answer else None  # verl's "solution" is only the final answer


def _get_path(row: Any, path: str) -> Any:
    """Follow a dotted path (``a.b``, ``prompt.0.content``) into dicts and lists."""
    node = row
    for part in path.split("."):
        if isinstance(node, Mapping):
            node = node.get(part, MISSING)  # MISSING is no container: the next part returns it
        elif isinstance(node, Sequence) and not isinstance(node, str):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                return MISSING
        else:
            return MISSING
    return node


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


def _row_fields(obj: Any, problem_field: str | None, answer_field: str | None) -> tuple[str, str, str | None] | str:
    """``(problem, answer, solution)`` of a row, or why the row is unusable."""
    if not isinstance(obj, Mapping):
        return f"expected an object, got {type(obj).__name__}"
    if problem_field is None:
        p_name, p_value = _auto_problem(obj)
    else:
        p_name, p_value = problem_field, _get_path(obj, problem_field)
    if answer_field is None:
        a_name, a_value = _auto_answer(obj)
    elif answer_field.startswith(BOXED_PREFIX):
        a_path = answer_field.removeprefix(BOXED_PREFIX)
        a_name, a_value = answer_field, extract_last_boxed(_get_path(obj, a_path))
    else:
        a_name, a_value = answer_field, _get_path(obj, answer_field)
    problem, answer = _problem_text(p_value), _answer_to_str(a_value)
    if problem is None:
        return f"{'missing' if p_value is MISSING else 'empty'} problem (field {p_name!r})"
    if answer is None:
        return f"{'missing' if a_value is MISSING else 'empty'} answer (field {a_name!r})"
    solution = obj.get("solution")
    if isinstance(a_value, str) and "####" in a_value and solution is None:
        solution = a_value.rsplit("####", 1)[0]  # GSM8K: the rationale before the answer
    return problem, answer, _solution_to_str(solution, answer)


def _problem_text(value: Any) -> str | None:
    """The problem less known instructions; a ready Qwen chat string reduced to its user turn."""
    if value is MISSING or value is None:
        return None
    _, found, body = str(value).partition("<|im_start|>user\n")
    return strip_instructions(body.partition("<|im_end|>")[0] if found else str(value)) or None


def _read_jsonl(path: Path) -> Rows:
    row = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
            yield row, lineno, obj
            row += 1


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _read_json(path: Path) -> Rows:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # some ".json" files are really JSON Lines
        first_line = text.lstrip().split("\n", 1)[0]
        if e.lineno > 1 and first_line.startswith("{") and _parses(first_line):
            yield from _read_jsonl(path)
            return
        raise DataError(f"{path}: line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
    if isinstance(data, Mapping):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    yield from ((i, None, obj) for i, obj in enumerate(data))


def _read_parquet(path: Path, columns: set[str] | None = None) -> Rows:
    try:
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        keep = [n for n in names if columns is None or n in columns]
        table = pq.read_table(path, columns=keep)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet file: {e}") from e
    yield from ((i, None, obj) for i, obj in enumerate(table.to_pylist()))


_READERS: dict[str, Callable[..., Rows]] = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def _columns_needed(problem_field: str | None, answer_field: str | None) -> set[str]:
    """Top-level columns the field mapping can touch (parquet reads only these: much faster)."""
    cols = {"solution"}
    if problem_field is None:
        cols |= {"problem", "question", "prompt"}
    if answer_field is None:
        cols |= {f.split(".")[0] for f in ANSWER_FIELDS}
    for f in (problem_field, answer_field):
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


def _check_options(on_bad_row: str, limit: int | None) -> None:
    if on_bad_row not in ("skip", "raise"):
        raise ValueError(f"on_bad_row must be 'skip' or 'raise', got {on_bad_row!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")


def _examples(
    rows: Rows, where: str, source: str, problem_field: str | None, answer_field: str | None,
    limit: int | None, on_bad_row: str, kind: str = "file",
) -> list[MathExample]:
    """The usable rows as examples; bad ones skipped (one warning) or raised, naming ``where`` and row."""
    examples: list[MathExample] = []
    bad: list[tuple[int, str]] = []  # (row, why it is unusable)
    total = 0
    for row, lineno, obj in rows:
        if limit is not None and len(examples) >= limit:
            break
        total += 1
        fields = _row_fields(obj, problem_field, answer_field)
        if isinstance(fields, str):
            if on_bad_row == "raise":
                line = f" (line {lineno})" if lineno is not None else ""
                raise DataError(f"{where}: row {row}{line}: {fields}")
            bad.append((row, fields))
            continue
        problem, answer, solution = fields
        examples.append(MathExample.make(problem, answer, source, row, solution))

    if bad:
        shown = ", ".join(str(r) for r, _ in bad[:_MAX_ROWS_SHOWN])
        more = ", ..." if len(bad) > _MAX_ROWS_SHOWN else ""
        log.warning(
            "%s: skipped %d of %d rows with a missing or empty problem/answer (rows %s%s; first: %s)",
            where, len(bad), total, shown, more, bad[0][1],
        )
    if not examples and limit != 0:  # what is built on such a file would fail later, far from it
        if total == 0:
            raise DataError(f"{where}: the {kind} holds no rows (empty)")
        raise DataError(
            f"{where}: none of its {total} rows is usable (missing or empty problem/answer; "
            f"first: row {bad[0][0]}: {bad[0][1]})"
        )
    return examples


def load_math_file(
    path: str | Path | None = None, *, name: str | None = None, problem_field: str | None = None,
    answer_field: str | None = None, limit: int | None = None, on_bad_row: str = "skip",
    hub: str | None = None, split: str = "train",
) -> list[MathExample]:
    """Read a .jsonl / .json (list of objects) / .parquet file, or ``hub`` (:func:`load_math_hub`).

    ``answer_field="boxed:<path>"``: the last ``\\boxed{}`` of a field. ``limit``: rows after it are
    not read. A bad file, or a bad row with ``on_bad_row="raise"``, is a :class:`DataError`.
    """
    if (path is None) == (hub is None):
        raise ValueError(f"give a file path or a hub data set, not both or neither (path={path!r}, hub={hub!r})")
    if hub is not None:
        return load_math_hub(hub, split=split, name=name, problem_field=problem_field,
                             answer_field=answer_field, limit=limit, on_bad_row=on_bad_row)
    _check_options(on_bad_row, limit)
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unknown file extension {path.suffix!r} (expected one of {sorted(_READERS)})")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    source = name if name is not None else default_name(path)
    rows = reader(path, _columns_needed(problem_field, answer_field)) if reader is _read_parquet else reader(path)
    return _examples(rows, str(path), source, problem_field, answer_field, limit, on_bad_row)


def _hub_where(hub: str, subset: str | None, split: str, data_files: Any) -> str:
    """How errors name a hub data set: ``hub data set 'org/name' (subset 'x', split 'test')``."""
    parts = [f"subset {subset!r}"] if subset else []
    if data_files is not None:
        parts.append(f"data_files {data_files!r}")
    parts.append(f"split {split!r}")
    return f"hub data set {hub!r} ({', '.join(parts)})"


def _read_hub(
    hub: str, subset: str | None, split: str, data_files: Any, revision: str | None,
    columns: set[str], where: str,
) -> Rows:
    """The rows of ``datasets.load_dataset``, only the columns the field mapping can touch."""
    try:
        import datasets

        table = datasets.load_dataset(hub, subset, split=split, data_files=data_files, revision=revision)
    except Exception as e:  # missing data set, offline, bad split, unreadable file: many types
        raise DataError(f"{where}: cannot load: {type(e).__name__}: {e}") from e
    if not isinstance(table, datasets.Dataset):
        raise DataError(f"{where}: expected one split, got {type(table).__name__}")
    table = table.select_columns([c for c in table.column_names if c in columns])
    yield from ((i, None, obj) for i, obj in enumerate(table))


def load_math_hub(
    hub: str, *, split: str = "train", subset: str | None = None, data_files: Any = None,
    revision: str | None = None, name: str | None = None, problem_field: str | None = None,
    answer_field: str | None = None, limit: int | None = None, on_bad_row: str = "skip",
) -> list[MathExample]:
    """Read a hub data set (``hub="HuggingFaceH4/MATH-500", split="test"``) with ``datasets.load_dataset``,
    or local files (``hub="parquet"`` / ``"json"`` with ``data_files``). Fields and bad rows as
    :func:`load_math_file`; ``name`` defaults to the local file's name, else the data set's."""
    _check_options(on_bad_row, limit)
    if isinstance(data_files, Path):  # datasets takes strings, not paths
        data_files = str(data_files)
    elif isinstance(data_files, (list, tuple)):
        data_files = [str(f) for f in data_files]
    where = _hub_where(hub, subset, split, data_files)
    if data_files is None and hub in _FILE_BUILDERS:  # it would read every such file under the cwd
        raise DataError(f"{where}: the {hub!r} builder needs data_files (the local files to read)")
    columns = _columns_needed(problem_field, answer_field)
    rows = _read_hub(hub, subset, split, data_files, revision, columns, where)
    if name is None:
        name = default_name(data_files) if isinstance(data_files, str) else hub.rstrip("/").rsplit("/", 1)[-1]
    return _examples(rows, where, name, problem_field, answer_field, limit, on_bad_row, "data set")
