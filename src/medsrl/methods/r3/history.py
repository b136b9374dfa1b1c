"""Per-prompt history of whole responses, shared by R3's replay, reflection and ranking; replicated
(every rank makes the same ``add`` calls in the same order, ``digest`` checks it).
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.utils import columnar
from medsrl.utils.columnar import Column, Ragged, check, normalise, to_columns, to_rows

FORMAT = columnar.Format("ResponseHistory", "medsrl.response_history", 1)
_STATE = "ResponseHistory state"
_PER_KEY = (Column("keys", str), *(Column(n, np.int64) for n in ("rows_per_key", "visits", "last_step")))
_FIELDS = (  # those of StoredResponse, in the snapshot's column order
    Column("step", np.int64),
    Column("correct", np.bool_),
    Column("reward", np.float64),
    Column("finish_reason", str),
    Column("extracted", str, nullable=True),
    Column("has_box", np.bool_),
    Column("text", str),
    Column("token_ids", np.int64, ragged=True),
    Column("logprobs", np.float32, ragged=True, nullable=True),
)
_SNAPSHOT = (Column("key", str), *_FIELDS)


@dataclass(frozen=True)
class StoredResponse:
    """One sampled response and its grade; fields normalised (float32 log-probs): round trips are bit-exact."""

    token_ids: tuple[int, ...]
    text: str
    reward: float  # the graded reward of the step (correctness + terms such as overlong)
    correct: bool
    step: int  # training step it was sampled at
    finish_reason: str  # "stop" | "length"
    extracted: str | None  # the grader's extracted answer (None: no box)
    has_box: bool
    # behaviour log-probs of token_ids (old-policy, of the step that sampled it); None: never scored
    logprobs: tuple[float, ...] | None

    def __post_init__(self) -> None:  # frozen: the normalised fields are written directly
        self.__dict__.update({c.name: normalise(getattr(self, c.name), c) for c in _FIELDS})
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs has length {len(self.logprobs)} but token_ids has length {len(self.token_ids)}")

    @classmethod
    def _trusted(cls, **fields: Any) -> StoredResponse:
        """From typed columns: the per-token normalisation would dominate a large load."""
        obj = object.__new__(cls)
        obj.__dict__.update(fields)
        return obj


class ResponseHistory:
    """Stored responses per prompt key, oldest first (beyond ``cap_per_key``, the oldest goes), and per
    key its visits: the steps it was added in (an ``add`` whose step differs from its last), never capped."""

    def __init__(self, cap_per_key: int | None = None) -> None:
        self.cap_per_key = columnar.check_cap(cap_per_key, "ResponseHistory")
        self._rows: dict[str, deque[StoredResponse]] = {}
        self._visits: dict[str, int] = {}
        self._last_step: dict[str, int] = {}

    def add(self, key: str, response: StoredResponse) -> None:
        self._rows.setdefault(key, deque(maxlen=self.cap_per_key)).append(response)
        if self._last_step.get(key) != response.step:
            self._visits[key] = self._visits.get(key, 0) + 1
            self._last_step[key] = response.step

    def responses(self, key: str) -> list[StoredResponse]:
        return list(self._rows.get(key, ()))

    def recent(self, key: str, correct: bool, k: int) -> list[StoredResponse]:
        """Up to ``k`` of ``key``'s responses with that outcome, newest first (within a step: added later first)."""
        newest_first = [r for r in reversed(self._rows.get(key, ())) if r.correct == correct]
        return sorted(newest_first, key=lambda r: -r.step)[: max(k, 0)]  # stable: ties stay

    def mean_reward(self, key: str) -> float | None:
        rows = self._rows.get(key)
        return math.fsum(r.reward for r in rows) / len(rows) if rows else None

    def visits(self, key: str) -> int:
        return self._visits.get(key, 0)

    def keys(self) -> list[str]:
        return list(self._rows)

    def num_keys(self) -> int:
        return len(self._rows)

    def num_responses(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def _columns(self) -> dict[str, Any]:
        """Per key, then per response (grouped by key, oldest first): behind state, digest and snapshot."""
        keys = list(self._rows)
        rows = [r for k in keys for r in self._rows[k]]
        per_key = {"rows_per_key": {k: len(v) for k, v in self._rows.items()}, "visits": self._visits}
        per_key["last_step"] = self._last_step
        ints = {name: np.array([d[k] for k in keys], np.int64) for name, d in per_key.items()}
        return {"keys": keys, **ints, **to_columns(rows, _FIELDS)}

    def state_dict(self) -> dict[str, Any]:
        """An exact columnar copy for ``torch.load(weights_only=True)``; row i's token ids are
        ``token_ids[token_offsets[i]:token_offsets[i + 1]]``, ``logprobs`` those of the ``has_logprobs`` rows."""
        cols = self._columns()
        ids, lps = cols.pop("token_ids"), cols.pop("logprobs")
        cols.update(token_ids=ids.values, token_offsets=ids.offsets, logprobs=lps.values, has_logprobs=lps.present)
        return {**FORMAT.header(), "cap_per_key": self.cap_per_key, **columnar.pack(cols, as_tensors=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state``, validated first; the history keeps its own ``cap_per_key``."""
        FORMAT.check(state, ("cap_per_key", "token_ids", "token_offsets", "logprobs", "has_logprobs"))
        per_key = _check_keys(state, state["cap_per_key"], _STATE)
        n = int(per_key["rows_per_key"].sum())
        lengths = np.diff(check(state, [Column("token_offsets", np.int64)], n + 1, _STATE)["token_offsets"])
        ragged = {
            "token_ids": Ragged(state["token_ids"], lengths, np.ones(n, bool)),
            "logprobs": Ragged(state["logprobs"], lengths, state["has_logprobs"]),
        }
        self._set(per_key, check({**state, **ragged}, _FIELDS, n, _STATE))

    def _set(self, per_key: dict[str, Any], rows: dict[str, Any]) -> None:
        responses = to_rows(rows, _FIELDS, StoredResponse._trusted)
        keys, ranges = per_key["keys"], per_key["ranges"]
        self._rows = {k: deque(responses[r], maxlen=self.cap_per_key) for k, r in zip(keys, ranges, strict=True)}
        self._visits = dict(zip(keys, per_key["visits"].tolist(), strict=True))
        self._last_step = dict(zip(keys, per_key["last_step"].tolist(), strict=True))

    def digest(self) -> str:
        return columnar.digest(self._columns(), FORMAT.name, FORMAT.version, self.cap_per_key)

    def snapshot(self, path: str | os.PathLike) -> Path:
        """One Parquet file (atomically), a row per stored response: ``pandas.read_parquet(path)``."""
        cols = {"key": [k for k, rows in self._rows.items() for _ in rows], **self._columns()}
        return FORMAT.save_parquet(path, cols, _SNAPSHOT, cap_per_key=self.cap_per_key)

    @classmethod
    def load_snapshot(cls, path: str | os.PathLike) -> ResponseHistory:
        """A history from a ``snapshot`` file: a key's visits are the distinct steps of its stored rows."""
        cols, meta = FORMAT.load_parquet(path, _SNAPSHOT)
        cols = check(cols, _SNAPSHOT, None, str(path))
        key, n = cols["key"], len(cols["key"])
        bounds = [i for i in range(n) if i == 0 or key[i] != key[i - 1]] + [n]
        steps = [cols["step"][a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        per_key = {
            "keys": [key[i] for i in bounds[:-1]],  # a key twice: its rows were not together
            "rows_per_key": np.array([len(s) for s in steps], np.int64),
            "visits": np.array([len(np.unique(s)) for s in steps], np.int64),
            "last_step": np.array([s.max() for s in steps], np.int64),
        }
        per_key = _check_keys(per_key, meta.get("cap_per_key"), str(path))
        hist = cls(cap_per_key=meta.get("cap_per_key"))
        hist._set(per_key, cols)
        return hist


load_snapshot = ResponseHistory.load_snapshot


def _check_keys(columns: dict[str, Any], cap: Any, where: str) -> dict[str, Any]:
    """The per-key columns, checked, and each key's rows."""
    columnar.check_cap(cap, where)
    k = check(columns, _PER_KEY, None, where)
    if len(set(k["keys"])) != len(k["keys"]):
        raise ValueError(f"{where}: keys are not unique")
    if (k["visits"] < 0).any():
        raise ValueError(f"{where}: negative visits")
    if cap is not None and (k["rows_per_key"] > cap).any():
        raise ValueError(f"{where}: a key holds more than cap_per_key={cap} rows")
    return {**k, "ranges": columnar.row_ranges(k["rows_per_key"], where)}
