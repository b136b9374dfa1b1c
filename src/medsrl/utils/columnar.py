"""Columnar state of the replicated per-key stores (MEDS's memory, R3's history): typed columns
that :func:`check` tests before a store changes anything (a corrupt checkpoint raises naming the
field, never half-loads), :func:`digest` hashes across ranks and :class:`Format` writes."""

from __future__ import annotations

import hashlib
import itertools
import json
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from medsrl.utils.atomic_file import atomic_write


@dataclass(frozen=True)
class Column:
    """numpy scalar type ``dtype`` (``str``: a list of text); ``ragged``: a sequence per row;
    ``nullable``: text or sequences may be None."""

    name: str
    dtype: Any
    ndim: int = 1
    nullable: bool = False
    ragged: bool = False


class Ragged(NamedTuple):
    """A sequence per row: the ``values`` of the ``present`` rows end to end, and row lengths."""

    values: np.ndarray
    lengths: np.ndarray
    present: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        """[n + 1]: where each row starts in ``values`` (a row not present takes no values)."""
        return np.concatenate([[0], np.cumsum(np.where(self.present, self.lengths, 0))]).astype(np.int64)


def check_cap(cap: Any, where: str) -> int | None:
    """``cap_per_key``, checked to be None or an int >= 1."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 1):
        raise ValueError(f"{where}: cap_per_key must be None or >= 1, got {cap!r}")
    return cap


def normalise(value: Any, col: Column) -> Any:
    """``value`` as the python value ``to_rows`` gives for ``col`` (ragged: a tuple)."""
    if value is None and col.nullable:
        return None
    if col.ragged:
        arr = np.asarray(value, col.dtype)
        if arr.ndim != 1:
            raise ValueError(f"{col.name} must be 1-d, got shape {arr.shape}")
        return tuple(arr.tolist())
    return str(value) if col.dtype is str else np.dtype(col.dtype).type(value).item()


def to_columns(rows: list, declared: Iterable[Column]) -> dict[str, Any]:
    """The ``declared`` attributes of ``rows`` as columns (the layout :func:`check` returns)."""
    out: dict[str, Any] = {}
    for col in declared:
        values = [getattr(r, col.name) for r in rows]
        if col.ragged:
            lengths = np.array([0 if v is None else len(v) for v in values], np.int64)
            flat = itertools.chain.from_iterable(v for v in values if v is not None)
            present = np.array([v is not None for v in values], bool)
            out[col.name] = Ragged(np.fromiter(flat, col.dtype, int(lengths.sum())), lengths, present)
        else:
            out[col.name] = values if col.dtype is str else np.array(values, col.dtype).reshape(-1)
    return out


def to_rows(columns: Mapping[str, Any], declared: Sequence[Column], make: Callable[..., Any]) -> list:
    """Inverse of :func:`to_columns`: ``make(**fields)`` per row, of python scalars and tuples."""
    names = [c.name for c in declared]
    lists = [_as_list(columns[c.name], c) for c in declared]
    return [make(**dict(zip(names, row, strict=True))) for row in zip(*lists, strict=True)]


def _as_list(value: Any, col: Column) -> list:
    if not col.ragged:
        return value if col.dtype is str else value.tolist()
    values, ends = value.values.tolist(), value.offsets.tolist()
    return [tuple(values[a:b]) if p else None
            for a, b, p in zip(ends[:-1], ends[1:], value.present.tolist(), strict=True)]


def pack(columns: Mapping[str, Any], *, as_tensors: bool) -> dict[str, Any]:
    """Copies of array and text ``columns`` for a state dict: numpy arrays, or CPU tensors (which
    ``torch.load(weights_only=True)`` accepts)."""
    out = {k: list(v) if isinstance(v, list) else np.array(v) for k, v in columns.items()}
    if as_tensors:
        import torch

        out = {k: v if isinstance(v, list) else torch.from_numpy(v) for k, v in out.items()}
    return out


def row_ranges(counts: np.ndarray, where: str) -> list[slice]:
    if (counts < 0).any():
        raise ValueError(f"{where}: negative row counts {counts.tolist()}")
    ends = np.cumsum(counts).tolist()
    return [slice(end - c, end) for end, c in zip(ends, counts.tolist(), strict=True)]


def check(columns: Mapping[str, Any], declared: Iterable[Column], n: int | None, where: str) -> dict:
    """The ``declared`` columns of ``columns``, each checked to be of its type with ``n`` rows
    (None: as the first column's); else a ``ValueError`` starting with ``where``, naming it."""
    out = {}
    for col in declared:
        if col.name not in columns:
            raise ValueError(f"{where} lacks {col.name!r}")
        value = out[col.name] = _checked(columns[col.name], col, where)
        rows = len(value.lengths) if col.ragged else len(value)
        n = rows if n is None else n
        if rows != n:
            raise ValueError(f"{where}: {col.name} has {rows} entries, expected {n}")
    return out


def _checked(value: Any, col: Column, where: str) -> Any:
    if col.ragged:
        values = _array(value[0], col.dtype, 1, col.name, where)
        lengths = _array(value[1], np.int64, 1, f"{col.name} lengths", where)
        present = _array(value[2], np.bool_, 1, f"{col.name} presence", where)
        held = int(lengths[present].sum()) if len(present) == len(lengths) else -1
        if held != len(values) or (lengths < 0).any() or not (col.nullable or present.all()):
            raise ValueError(f"{where}: {col.name} has {len(values)} values, but its rows hold {held}")
        return Ragged(values, lengths, present)
    if col.dtype is not str:
        return _array(value, col.dtype, col.ndim, col.name, where)
    if not isinstance(value, list) or not all(isinstance(s, str) or (col.nullable and s is None) for s in value):
        raise ValueError(f"{where}: {col.name} must be a list of str")
    return value


def _array(value: Any, dtype: Any, ndim: int, name: str, where: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as e:  # e.g. a CUDA tensor or a ragged list
        raise ValueError(f"{where}: {name} is not an array ({e})") from e
    if arr.dtype != dtype or arr.ndim != ndim:
        raise ValueError(f"{where}: {name} is {arr.dtype}{arr.shape}, expected {ndim}-d {np.dtype(dtype)}")
    return arr


def digest(columns: Mapping[str, Any], *header: Any) -> str:
    """SHA-1 over ``header`` and each column's name, dtype, shape and bytes: equal columns (the
    replicas of all ranks) give equal digests, and no two layouts share one."""
    h = hashlib.sha1(json.dumps(header).encode())
    for name, value in columns.items():
        _hash(h, name, value)
    return h.hexdigest()


def _hash(h: Any, name: str, value: Any) -> None:
    if isinstance(value, Ragged):
        for part, array in zip(value._fields, value, strict=True):
            _hash(h, f"{name}.{part}", array)
    elif isinstance(value, list):  # text: UTF-8 byte lengths (-1: None), then the bytes
        encoded = [None if s is None else s.encode("utf-8") for s in value]
        _hash(h, f"{name}.len", np.array([-1 if b is None else len(b) for b in encoded], np.int64))
        h.update(b"".join(b for b in encoded if b is not None))
    else:
        arr = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
        h.update(f"{name}:{arr.dtype.str}:{arr.shape}:".encode() + arr.tobytes())


@dataclass(frozen=True)
class Format:
    """The name and version stamped on a store's state and snapshots (``owner``: its class)."""

    owner: str
    name: str
    version: int

    def header(self) -> dict[str, Any]:
        return {"format": self.name, "version": self.version}

    def check(self, state: Any, fields: Iterable[str] = (), what: str = "state") -> None:
        """Refuse anything but a dict of this format and version holding all ``fields``."""
        got = (state.get("format"), state.get("version")) if isinstance(state, dict) else (type(state), None)
        if got != (self.name, self.version):
            raise ValueError(
                f"not {'an' if self.owner[0] in 'AEIOU' else 'a'} {self.owner} {what} (format "
                f"{got[0]!r}, version {got[1]!r}; expected {self.name!r} version {self.version})"
            )
        missing = [f for f in fields if f not in state]
        if missing:
            raise ValueError(f"{self.owner} {what} lacks {missing}")

    def save_npz(self, path: str | os.PathLike, arrays: Mapping[str, np.ndarray], **meta: Any) -> Path:
        """``arrays`` as one ``.npz`` (no pickle), the header and ``meta`` as JSON."""
        arrays = {"meta": np.array(json.dumps({**self.header(), **meta})), **arrays}
        return atomic_write(path, lambda f: _write_npz(f, arrays))

    def load_npz(self, path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The arrays and the ``meta`` of a :meth:`save_npz` file of this format."""
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        meta = json.loads(str(arrays.pop("meta", "{}")))
        self.check(meta, what=f"snapshot ({path})")
        return arrays, meta

    def save_parquet(self, path: str | os.PathLike, columns: Mapping, declared: Iterable[Column], **meta: Any) -> Path:
        """The ``declared`` columns as one Parquet table, the header and ``meta`` in its metadata."""
        import pyarrow as pa

        metadata = {"medsrl.format": self.name, "medsrl.version": str(self.version)}
        metadata.update({f"medsrl.{k}": json.dumps(v) for k, v in meta.items()})
        table = pa.table({c.name: _to_arrow(columns[c.name], c) for c in declared}, metadata=metadata)
        return atomic_write(path, lambda f: _write_parquet(f, table))

    def load_parquet(self, path: str | os.PathLike, declared: Iterable[Column]) -> tuple[dict, dict]:
        """The ``declared`` columns (for :func:`check`) and the ``meta`` of a Parquet snapshot."""
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        raw = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        meta = {k[7:]: v if k == "medsrl.format" else json.loads(v) for k, v in raw.items() if k[:7] == "medsrl."}
        self.check(meta, what=f"snapshot ({path})")
        missing = [c.name for c in declared if c.name not in table.column_names]
        if missing:
            raise ValueError(f"{path}: snapshot lacks columns {missing}")
        return {c.name: _from_arrow(table.column(c.name).combine_chunks(), c) for c in declared}, meta


def _to_arrow(value: Any, col: Column) -> Any:
    import pyarrow as pa

    kind = pa.string() if col.dtype is str else pa.from_numpy_dtype(np.dtype(col.dtype))
    if not col.ragged:
        return pa.array(value, kind)
    mask = pa.array(~value.present) if col.nullable else None
    return pa.ListArray.from_arrays(pa.array(value.offsets, pa.int32()), pa.array(value.values, kind), mask=mask)


def _from_arrow(arr: Any, col: Column) -> Any:
    if col.ragged:
        lengths = arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        present = arr.is_valid().to_numpy(zero_copy_only=False)
        return Ragged(arr.flatten().to_numpy(zero_copy_only=False), lengths, present)
    return arr.to_pylist() if col.dtype is str else arr.to_numpy(zero_copy_only=False)


def _write_npz(f: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """Where the ``.npz`` bytes are written (tests break it to check atomicity)."""
    np.savez(f, **arrays)


def _write_parquet(f: Any, table: Any) -> None:
    """Where the Parquet bytes are written (tests break it to check atomicity)."""
    import pyarrow.parquet as pq

    pq.write_table(table, f)
