"""Per-prompt history of whole responses, shared by R3's replay, reflection and ranking.

Each prompt key keeps its stored responses in insertion order (oldest first); ``cap_per_key``
optionally keeps only the newest ones. ``visits`` counts the training steps in which the key was
added to, and is not reduced by the cap (a key's age, not its number of stored responses).

The history is replicated, not sharded: its caller feeds identical ``add`` calls in the same
order on every rank, so every rank holds the same history (``digest`` checks that cheaply).
It survives restarts two ways: ``state_dict``/``load_state_dict`` (columnar tensors and plain
python, loadable by ``torch.load(weights_only=True)``, for Lightning checkpoints) and
``snapshot``/``load_snapshot`` (one Parquet file a user can open without this package, written
atomically)::

    df = pandas.read_parquet(path)          # one row per stored response
    df[df.key == key].sort_values("step")   # the history of one prompt
    cap = pyarrow.parquet.read_schema(path).metadata[b"medsrl.cap_per_key"]  # JSON
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.utils.atomic_file import atomic_write

FORMAT = "medsrl.response_history"
VERSION = 1


@dataclass(frozen=True)
class StoredResponse:
    """One sampled response and what grading made of it, as an immutable value.

    ``token_ids`` and ``logprobs`` are normalised to tuples of python ints and of float32 values
    (the trainer's dtype), so checkpoint and snapshot round trips are bit-exact.
    """

    token_ids: tuple[int, ...]
    text: str
    reward: float  # the graded reward of the step (correctness + terms such as overlong)
    correct: bool
    step: int  # training step it was sampled at
    finish_reason: str  # "stop" | "length"
    extracted: str | None  # the grader's extracted answer (None: no box)
    has_box: bool
    # behaviour log-probs of token_ids (the old-policy log-probs of the step that sampled it);
    # None when the response never went through the scoring forward
    logprobs: tuple[float, ...] | None

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-d, got shape {ids.shape}")
        lp = self.logprobs
        if lp is not None:
            lp = np.asarray(lp, dtype=np.float32)
            if lp.ndim != 1 or lp.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"logprobs has length {lp.shape[0] if lp.ndim == 1 else lp.shape} but "
                    f"token_ids has length {ids.shape[0]}"
                )
            lp = tuple(lp.tolist())
        extracted = None if self.extracted is None else str(self.extracted)
        _set_fields(
            self,
            token_ids=tuple(ids.tolist()),
            text=str(self.text),
            reward=float(self.reward),
            correct=bool(self.correct),
            step=int(self.step),
            finish_reason=str(self.finish_reason),
            extracted=extracted,
            has_box=bool(self.has_box),
            logprobs=lp,
        )

    @classmethod
    def _trusted(cls, **fields: Any) -> StoredResponse:
        """Build from values already of the right types (loaded from typed columns), skipping
        the per-token normalisation that would dominate a large load."""
        obj = object.__new__(cls)
        _set_fields(obj, **fields)
        return obj


def _set_fields(obj: StoredResponse, **fields: Any) -> None:
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


class ResponseHistory:
    """Stored responses per prompt key, oldest first, with per-key visit counts.

    ``cap_per_key`` (None = unbounded) drops the oldest response of a key beyond the cap.
    A visit is a step in which ``add`` was called for the key: an ``add`` whose step differs
    from the key's last one counts a new visit (training steps only grow, so this counts the
    distinct steps without keeping them all).
    """

    def __init__(self, cap_per_key: int | None = None) -> None:
        if cap_per_key is not None and cap_per_key < 1:
            raise ValueError(f"cap_per_key must be >= 1 or None, got {cap_per_key}")
        self.cap_per_key = cap_per_key
        self._rows: dict[str, deque[StoredResponse]] = {}
        self._visits: dict[str, int] = {}
        self._last_step: dict[str, int] = {}

    # ----------------------------------------------------------------- changes
    def add(self, key: str, response: StoredResponse) -> None:
        """Append ``response`` to ``key``'s history (beyond the cap, its oldest one goes)."""
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = deque(maxlen=self.cap_per_key)
        rows.append(response)
        if self._last_step.get(key) != response.step:
            self._visits[key] = self._visits.get(key, 0) + 1
            self._last_step[key] = response.step

    def reset(self) -> None:
        self._rows.clear()
        self._visits.clear()
        self._last_step.clear()

    # ------------------------------------------------------------------ access
    def responses(self, key: str) -> list[StoredResponse]:
        """The stored responses of ``key``, oldest first ([] for an unknown key)."""
        return list(self._rows.get(key, ()))

    def recent(self, key: str, correct: bool, k: int) -> list[StoredResponse]:
        """Up to ``k`` stored responses of ``key`` with that outcome, most recent first: higher
        step first, and within a step the one added later first."""
        if k <= 0:
            return []
        newest_first = [r for r in reversed(self._rows.get(key, ())) if r.correct == correct]
        newest_first.sort(key=lambda r: -r.step)  # stable: ties keep later-added first
        return newest_first[:k]

    def mean_reward(self, key: str) -> float | None:
        """Mean reward over the stored responses of ``key``; None if none are stored."""
        rows = self._rows.get(key)
        if not rows:
            return None
        return math.fsum(r.reward for r in rows) / len(rows)

    def visits(self, key: str) -> int:
        """Number of distinct steps in which ``key`` was added to (not reduced by the cap)."""
        return self._visits.get(key, 0)

    def keys(self) -> list[str]:
        """All keys, in the order they first appeared."""
        return list(self._rows)

    def num_keys(self) -> int:
        return len(self._rows)

    def num_responses(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    # ------------------------------------------------------- checkpoint state
    def _columns(self) -> dict[str, Any]:
        """The whole history as columns (numpy arrays and lists of str), rows grouped by key in
        ``keys()`` order, oldest first: the one layout behind state, digest and snapshot."""
        keys = list(self._rows)
        rows = [r for key in keys for r in self._rows[key]]
        n = len(rows)
        lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, count=n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        has_lp = np.fromiter((r.logprobs is not None for r in rows), bool, count=n)
        with_lp = [r.logprobs for r in rows if r.logprobs is not None]
        return {
            "keys": keys,
            "rows_per_key": np.array([len(self._rows[k]) for k in keys], np.int64),
            "visits": np.array([self._visits[k] for k in keys], np.int64),
            "last_step": np.array([self._last_step[k] for k in keys], np.int64),
            "token_ids": np.fromiter(
                itertools.chain.from_iterable(r.token_ids for r in rows),
                np.int64,
                count=int(offsets[-1]),
            ),
            "token_offsets": offsets,
            "logprobs": np.fromiter(
                itertools.chain.from_iterable(with_lp), np.float32, count=int(lens[has_lp].sum())
            ),
            "has_logprobs": has_lp,
            "reward": np.fromiter((r.reward for r in rows), np.float64, count=n),
            "step": np.fromiter((r.step for r in rows), np.int64, count=n),
            "correct": np.fromiter((r.correct for r in rows), bool, count=n),
            "has_box": np.fromiter((r.has_box for r in rows), bool, count=n),
            "text": [r.text for r in rows],
            "finish_reason": [r.finish_reason for r in rows],
            "extracted": [r.extracted for r in rows],
        }

    def state_dict(self) -> dict[str, Any]:
        """Columnar copy of the history: CPU tensors for the numeric columns, lists of str for
        the text ones, so ``torch.load(weights_only=True)`` accepts it. Exact (int64 token ids
        and steps, float32 log-probs, float64 rewards).

        Rows are grouped by key in ``keys`` order (``rows_per_key``), oldest first; the token
        ids of row i are ``token_ids[token_offsets[i]:token_offsets[i + 1]]``; ``logprobs``
        concatenates those of the rows with ``has_logprobs`` only.
        """
        import torch

        cols = self._columns()
        state: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        state["cap_per_key"] = self.cap_per_key
        for name, value in cols.items():
            state[name] = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state`` (from ``state_dict``), after validating it.

        The inverse of ``state_dict``, except that the history keeps its own ``cap_per_key``
        (a run resumed with a smaller cap drops each key's oldest responses beyond it).
        """
        if not isinstance(state, dict):
            raise ValueError(f"not a ResponseHistory state: {type(state).__name__}")
        if state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ValueError(
                f"not a ResponseHistory state (format {state.get('format')!r}, version "
                f"{state.get('version')!r}; expected {FORMAT!r} version {VERSION})"
            )
        missing = [n for n in _STATE_COLUMNS if n not in state]
        if missing:
            raise ValueError(f"ResponseHistory state lacks {missing}")
        cap = state["cap_per_key"]
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"ResponseHistory state: cap_per_key {cap!r} is not None or >= 1")
        keys = _str_list(state["keys"], "keys")
        if len(set(keys)) != len(keys):
            raise ValueError("ResponseHistory state: keys are not unique")
        per_key = {n: _array(state[n], n, np.integer, len(keys)) for n in _KEY_COLUMNS}
        if (per_key["rows_per_key"] < 0).any() or (per_key["visits"] < 0).any():
            raise ValueError("ResponseHistory state: negative rows_per_key or visits")
        if cap is not None and (per_key["rows_per_key"] > cap).any():
            raise ValueError(f"ResponseHistory state: a key holds more than cap_per_key={cap} rows")
        n = int(per_key["rows_per_key"].sum())
        rows = _rows_from_columns(state, n)
        stores: dict[str, deque[StoredResponse]] = {}
        bounds = np.concatenate([[0], np.cumsum(per_key["rows_per_key"])]).tolist()
        for i, key in enumerate(keys):
            stores[key] = deque(rows[bounds[i] : bounds[i + 1]], maxlen=self.cap_per_key)
        self._rows = stores
        self._visits = dict(zip(keys, per_key["visits"].tolist(), strict=True))
        self._last_step = dict(zip(keys, per_key["last_step"].tolist(), strict=True))

    def digest(self) -> str:
        """SHA-1 over a canonical encoding of the whole state (cap, keys, every field of every
        response, visits): equal histories give equal digests, e.g. to check that all ranks
        hold the same replica. Hashes column bytes, not pickled rows."""
        cols = self._columns()
        h = hashlib.sha1()
        _hash_strings(h, "header", [FORMAT, str(VERSION), json.dumps(self.cap_per_key)])
        for name, value in cols.items():
            if isinstance(value, np.ndarray):
                raw = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
                h.update(f"{name}:{value.dtype.str}:{len(raw)}:".encode())
                h.update(raw)
            else:
                _hash_strings(h, name, value)
        return h.hexdigest()

    # ---------------------------------------------------------------- snapshot
    def snapshot(self, path: str | os.PathLike) -> Path:
        """Write the history to one Parquet file, atomically (``atomic_write``); returns the path.

        One row per stored response, grouped by key in ``keys()`` order, oldest first. Columns:
        ``key``, ``step`` (int64), ``correct``, ``reward`` (float64), ``finish_reason``,
        ``extracted`` (null: no box), ``has_box``, ``text``, ``token_ids`` (list<int64>),
        ``logprobs`` (list<float32>, null when None). ``cap_per_key`` is JSON in the schema
        metadata under ``medsrl.cap_per_key``. Visits are not stored (see ``load_snapshot``).
        """
        table = self._snapshot_table()
        return atomic_write(path, lambda f: _write_parquet(f, table))

    def _snapshot_table(self):
        import pyarrow as pa

        c = self._columns()
        lens = np.diff(c["token_offsets"])
        lp_offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(np.where(c["has_logprobs"], lens, 0), out=lp_offsets[1:])
        keys = np.repeat(np.array(c["keys"], dtype=object), c["rows_per_key"])
        columns = {
            "key": pa.array(keys.tolist(), pa.string()),
            "step": pa.array(c["step"], pa.int64()),
            "correct": pa.array(c["correct"], pa.bool_()),
            "reward": pa.array(c["reward"], pa.float64()),
            "finish_reason": pa.array(c["finish_reason"], pa.string()),
            "extracted": pa.array(c["extracted"], pa.string()),
            "has_box": pa.array(c["has_box"], pa.bool_()),
            "text": pa.array(c["text"], pa.string()),
            "token_ids": pa.ListArray.from_arrays(
                pa.array(c["token_offsets"], pa.int32()), pa.array(c["token_ids"], pa.int64())
            ),
            "logprobs": pa.ListArray.from_arrays(
                pa.array(lp_offsets, pa.int32()),
                pa.array(c["logprobs"], pa.float32()),
                mask=pa.array(~c["has_logprobs"], pa.bool_()),
            ),
        }
        metadata = {
            "medsrl.format": FORMAT,
            "medsrl.version": str(VERSION),
            "medsrl.cap_per_key": json.dumps(self.cap_per_key),
        }
        return pa.table(columns, metadata=metadata)

    @classmethod
    def load_snapshot(cls, path: str | os.PathLike) -> ResponseHistory:
        """Rebuild a history (including its ``cap_per_key``) from a ``snapshot`` file.

        The snapshot keeps only the stored responses, so each key's visits are rebuilt as the
        number of distinct steps among its stored rows (fewer than the original's once the cap
        has dropped responses of older steps), and its last step as the highest stored step.
        """
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        meta = table.schema.metadata or {}
        if meta.get(b"medsrl.format", b"").decode() != FORMAT:
            raise ValueError(f"{path} is not a ResponseHistory snapshot")
        missing = [n for n in _SNAPSHOT_COLUMNS if n not in table.column_names]
        if missing:
            raise ValueError(f"{path}: snapshot lacks columns {missing}")
        cap = json.loads(meta.get(b"medsrl.cap_per_key", b"null"))

        def col(name: str):
            return table.column(name).combine_chunks()

        tok, lp = col("token_ids"), col("logprobs")
        if tok.null_count:
            raise ValueError(f"{path}: token_ids has nulls")
        offsets = np.zeros(len(tok) + 1, np.int64)
        np.cumsum(tok.value_lengths().to_numpy(zero_copy_only=False), out=offsets[1:])
        columns = {
            "token_ids": tok.flatten().to_numpy(zero_copy_only=False).astype(np.int64),
            "token_offsets": offsets,
            "logprobs": lp.flatten().to_numpy(zero_copy_only=False).astype(np.float32),
            "has_logprobs": lp.is_valid().to_numpy(zero_copy_only=False),
            "reward": col("reward").to_numpy(zero_copy_only=False).astype(np.float64),
            "step": col("step").to_numpy(zero_copy_only=False).astype(np.int64),
            "correct": col("correct").to_numpy(zero_copy_only=False),
            "has_box": col("has_box").to_numpy(zero_copy_only=False),
            **{n: col(n).to_pylist() for n in ("text", "finish_reason", "extracted")},
        }
        row_keys = col("key").to_pylist()
        rows = _rows_from_columns(columns, len(row_keys))
        hist = cls(cap_per_key=cap)
        steps: dict[str, set[int]] = {}
        for key, row in zip(row_keys, rows, strict=True):
            if not isinstance(key, str):
                raise ValueError(f"{path}: a row has key {key!r}")
            hist._rows.setdefault(key, deque(maxlen=cap)).append(row)
            steps.setdefault(key, set()).add(row.step)
            if cap is not None and len(hist._rows[key]) > cap:
                raise ValueError(f"{path}: key {key!r} holds more than cap_per_key={cap} rows")
        hist._visits = {k: len(s) for k, s in steps.items()}
        hist._last_step = {k: max(s) for k, s in steps.items()}
        return hist


def load_snapshot(path: str | os.PathLike) -> ResponseHistory:
    """Module-level alias of ``ResponseHistory.load_snapshot``."""
    return ResponseHistory.load_snapshot(path)


def _write_parquet(f, table) -> None:
    """The one place the snapshot bytes are written (tests break it to check atomicity)."""
    import pyarrow.parquet as pq

    pq.write_table(table, f)


# ------------------------------------------------------------------- helpers
_KEY_COLUMNS = ("rows_per_key", "visits", "last_step")
_ROW_COLUMNS = ("token_offsets", "has_logprobs", "reward", "step", "correct", "has_box")
_TEXT_COLUMNS = ("text", "finish_reason", "extracted")
_STATE_COLUMNS = (
    ("cap_per_key", "keys", "token_ids", "logprobs") + _KEY_COLUMNS + _ROW_COLUMNS + _TEXT_COLUMNS
)
_SNAPSHOT_COLUMNS = (
    "key", "step", "correct", "reward", "finish_reason", "extracted", "has_box", "text",
    "token_ids", "logprobs",
)  # fmt: skip
_DTYPES = {
    "token_ids": np.int64,
    "token_offsets": np.int64,
    "logprobs": np.float32,
    "reward": np.float64,
    "step": np.int64,
    "has_logprobs": np.bool_,
    "correct": np.bool_,
    "has_box": np.bool_,
}


def _array(value: Any, name: str, kind: type, length: int | None = None) -> np.ndarray:
    """``value`` (tensor or array) as a 1-d numpy array of ``kind``, or a ValueError."""
    try:
        arr = np.asarray(value)
    except Exception as e:  # e.g. a CUDA tensor or a ragged list
        raise ValueError(f"ResponseHistory state: {name} is not an array ({e})") from e
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, kind):
        raise ValueError(
            f"ResponseHistory state: {name} is {arr.dtype}{arr.shape}, expected 1-d {kind.__name__}"
        )
    if length is not None and arr.shape[0] != length:
        raise ValueError(
            f"ResponseHistory state: {name} has {arr.shape[0]} entries, expected {length}"
        )
    return arr


def _str_list(value: Any, name: str, n: int | None = None, nullable: bool = False) -> list:
    ok = isinstance(value, list) and all(
        isinstance(s, str) or (nullable and s is None) for s in value
    )
    if not ok:
        raise ValueError(f"ResponseHistory state: {name} must be a list of str")
    if n is not None and len(value) != n:
        raise ValueError(f"ResponseHistory state: {name} has {len(value)} entries, expected {n}")
    return value


def _rows_from_columns(cols: dict[str, Any], n: int) -> list[StoredResponse]:
    """Validate the per-row columns (``n`` rows) and build the responses from them."""
    a = {name: _array(cols[name], name, _DTYPES[name]) for name in _DTYPES}
    for name in ("has_logprobs", "reward", "step", "correct", "has_box"):
        if a[name].shape[0] != n:
            raise ValueError(
                f"ResponseHistory state: {name} has {a[name].shape[0]} entries, expected {n}"
            )
    off = a["token_offsets"]
    if off.shape[0] != n + 1 or off[0] != 0 or (np.diff(off) < 0).any():
        raise ValueError(
            f"ResponseHistory state: token_offsets must be {n + 1} non-decreasing offsets from 0"
        )
    if off[-1] != a["token_ids"].shape[0]:
        raise ValueError(
            f"ResponseHistory state: token_offsets end at {off[-1]} but there are "
            f"{a['token_ids'].shape[0]} token ids"
        )
    has_lp = a["has_logprobs"]
    lens = np.diff(off)
    if int(lens[has_lp].sum()) != a["logprobs"].shape[0]:
        raise ValueError(
            f"ResponseHistory state: {a['logprobs'].shape[0]} logprobs, but the rows with "
            f"has_logprobs hold {int(lens[has_lp].sum())} tokens"
        )
    text = _str_list(cols["text"], "text", n)
    finish = _str_list(cols["finish_reason"], "finish_reason", n)
    extracted = _str_list(cols["extracted"], "extracted", n, nullable=True)
    ids, lps, offs = a["token_ids"].tolist(), a["logprobs"].tolist(), off.tolist()
    lp_at = 0
    rows = []
    for i, (flag, reward, step, correct, has_box) in enumerate(
        zip(
            has_lp.tolist(),
            a["reward"].tolist(),
            a["step"].tolist(),
            a["correct"].tolist(),
            a["has_box"].tolist(),
            strict=True,
        )
    ):
        lo, hi = offs[i], offs[i + 1]
        lp = None
        if flag:
            lp = tuple(lps[lp_at : lp_at + hi - lo])
            lp_at += hi - lo
        rows.append(
            StoredResponse._trusted(
                token_ids=tuple(ids[lo:hi]),
                text=text[i],
                reward=reward,
                correct=correct,
                step=step,
                finish_reason=finish[i],
                extracted=extracted[i],
                has_box=has_box,
                logprobs=lp,
            )
        )
    return rows


def _hash_strings(h, name: str, strings: Iterable[str | None]) -> None:
    """Hash strings unambiguously: their UTF-8 byte lengths (-1 for None), then the bytes."""
    encoded = [None if s is None else s.encode("utf-8") for s in strings]
    lens = np.array([-1 if b is None else len(b) for b in encoded], dtype="<i8")
    h.update(f"{name}:str:{len(encoded)}:".encode())
    h.update(lens.tobytes())
    h.update(b"".join(b for b in encoded if b is not None))
