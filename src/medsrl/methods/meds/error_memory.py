"""MEDS error memory: one store per ``(prompt_key, correct)`` (docs/REFERENCE.md step 3) of past
responses' features [N, D] in insertion order, the step of each row, and the labels of the last
HDBSCAN re-fit over the first ``fitted_upto`` rows (later rows: -1). Unbounded in the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.utils.columnar import Column, Format, check, check_cap, digest, pack, row_ranges

MemoryKey = tuple[str, bool]  # (prompt key, response was correct)

FORMAT = Format("ErrorMemory", "medsrl.error_memory", 1)
_STORE = (Column("features", np.float32, ndim=2), Column("steps", np.int64), Column("labels", np.int64))
_SNAPSHOT_STORES = (
    Column("store_correct", np.bool_), Column("store_rows", np.int64), Column("store_fitted_upto", np.int64)
)
_SNAPSHOT_ROWS = (Column("features", np.float32, ndim=2), Column("step", np.int64), Column("label", np.int64))


def _frozen(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


@dataclass
class MemoryEntry:
    """One store, as a value: arrays are read-only and the memory replaces an entry rather than change it."""

    features: np.ndarray  # [N, D] float32
    steps: np.ndarray  # [N] int64, the step each row was added at
    labels: np.ndarray  # [N] int64, -1 = noise or not yet fitted
    fitted_upto: int = 0  # labels[:fitted_upto] come from the last re-fit

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    @property
    def fitted_features(self) -> np.ndarray:
        return self.features[: self.fitted_upto]

    @property
    def fitted_labels(self) -> np.ndarray:
        return self.labels[: self.fitted_upto]


class ErrorMemory:
    """The stores, of one feature dimension; ``cap_per_key`` (None = unbounded) keeps each store's newest rows."""

    def __init__(self, cap_per_key: int | None = None) -> None:
        self.cap_per_key = check_cap(cap_per_key, "ErrorMemory")
        self.dim: int | None = None  # fixed by the first add
        self._stores: dict[MemoryKey, MemoryEntry] = {}

    def get(self, key: str, correct: bool) -> MemoryEntry | None:
        return self._stores.get((key, bool(correct)))

    def keys(self) -> list[MemoryKey]:
        """In the order they were first filled."""
        return list(self._stores)

    def num_entries(self) -> int:
        return sum(len(e) for e in self._stores.values())

    def num_keys(self) -> int:
        return len(self._stores)

    def add(self, key: str, correct: bool, features: np.ndarray, step: int) -> None:
        correct = bool(correct)
        x = np.asarray(features, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"features for key {key!r} must be [m, D], got shape {x.shape}")
        if self.dim is not None and x.shape[1] != self.dim:
            raise ValueError(f"feature dim {x.shape[1]} for key {key!r} (correct={correct}) does not match the "
                             f"memory's feature dim {self.dim}")
        if x.shape[0] == 0:
            return
        if not np.isfinite(x).all():
            raise ValueError(f"features for key {key!r} (correct={correct}) contain NaN or inf")
        self.dim = x.shape[1]
        m = x.shape[0]
        old = self._stores.get((key, correct))
        if old is None:
            old = MemoryEntry(np.zeros((0, self.dim), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._stores[(key, correct)] = self._capped(
            np.concatenate([old.features, x]),
            np.concatenate([old.steps, np.full(m, step, np.int64)]),
            np.concatenate([old.labels, np.full(m, -1, np.int64)]),
            old.fitted_upto,
        )

    def _capped(self, features: np.ndarray, steps: np.ndarray, labels: np.ndarray, upto: int) -> MemoryEntry:
        """A read-only entry of the newest ``cap_per_key`` rows."""
        drop = 0 if self.cap_per_key is None else max(0, len(steps) - self.cap_per_key)
        arrays = (_frozen(np.array(a[drop:])) for a in (features, steps, labels))
        return MemoryEntry(*arrays, max(0, upto - drop))

    def set_labels(self, key: str, correct: bool, labels: np.ndarray) -> None:
        """The labels of a re-fit over the store's first ``len(labels)`` rows as they are now (with a
        cap, a fit from before a later ``add`` is misaligned: collect it before the key's next ``add``)."""
        entry = self._stores.get((key, bool(correct)))
        if entry is None:
            raise KeyError(f"no memory for key {key!r} (correct={bool(correct)})")
        lab = np.asarray(labels, dtype=np.int64)
        upto = len(lab)
        if lab.ndim != 1 or upto > len(entry):
            raise ValueError(f"labels of shape {lab.shape} do not fit the {len(entry)} rows "
                             f"stored for key {key!r} (correct={bool(correct)})")
        new = np.full(len(entry), -1, np.int64)
        new[:upto] = lab
        self._stores[(key, bool(correct))] = replace(entry, labels=_frozen(new), fitted_upto=upto)

    def reset(self) -> None:
        self._stores.clear()
        self.dim = None

    def state_dict(self, *, as_tensors: bool = False) -> dict[str, Any]:
        """An exact copy; ``as_tensors=True``: CPU tensors, for ``torch.load(weights_only=True)``."""
        entries = [
            {"key": key, "correct": correct,
             **pack({c.name: getattr(e, c.name) for c in _STORE}, as_tensors=as_tensors),
             "fitted_upto": int(e.fitted_upto)}
            for (key, correct), e in self._stores.items()
        ]  # fmt: skip
        return {**FORMAT.header(), "dim": self.dim, "cap_per_key": self.cap_per_key, "entries": entries}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state``, validated first; the memory keeps its own ``cap_per_key``."""
        FORMAT.check(state, ("dim", "entries"))
        dim, stores = state["dim"], {}
        for e in state["entries"]:
            key, correct = str(e["key"]), bool(e["correct"])
            where = f"ErrorMemory state, key {key!r} (correct={correct})"
            cols, upto = check(e, _STORE, None, where), int(e["fitted_upto"])
            if cols["features"].shape[1] != dim or not 0 <= upto <= len(cols["steps"]):
                raise ValueError(f"{where}: features {cols['features'].shape} and fitted_upto {upto} do not fit "
                                 f"the memory's feature dim {dim}")
            if (key, correct) in stores:
                raise ValueError(f"{where} appears twice")
            stores[(key, correct)] = self._capped(cols["features"], cols["steps"], cols["labels"], upto)
        self._stores, self.dim = stores, (None if dim is None else int(dim))

    def digest(self) -> str:
        """SHA-1 of the keys, features and steps: do all ranks hold the same replica? Not the labels: a
        re-fit may have landed on one rank and not yet on another."""
        cols = self._columns()
        names = ("store_correct", "store_rows", "step", "features")
        return digest({"keys": [k for k, _ in self._stores], **{n: cols[n] for n in names}}, FORMAT.name)

    def snapshot(self, path: str | os.PathLike) -> Path:
        """The memory as one ``.npz`` file (``_columns``, written atomically), which numpy opens alone:
        ``np.load(path)``; ``json.loads(str(z["meta"]))`` has the keys (``z["store"]`` indexes them)."""
        keys = [key for key, _ in self._stores]
        return FORMAT.save_npz(path, self._columns(), dim=self.dim, cap_per_key=self.cap_per_key, keys=keys)

    def _columns(self) -> dict[str, np.ndarray]:
        """All stores end to end in ``keys()`` order: per row ``store`` (index into the keys),
        ``correct``, ``step``, ``label``, ``features``; per store ``store_*``."""
        entries = list(self._stores.values())
        flags = np.array([c for _, c in self._stores], bool)
        rows = np.array([len(e) for e in entries], np.int64)

        def cat(name: str, empty: np.ndarray) -> np.ndarray:
            return np.concatenate([empty, *(getattr(e, name) for e in entries)])

        return {
            "store": np.repeat(np.arange(len(entries), dtype=np.int64), rows),
            "correct": np.repeat(flags, rows),
            "step": cat("steps", np.zeros(0, np.int64)),
            "label": cat("labels", np.zeros(0, np.int64)),
            "features": cat("features", np.zeros((0, self.dim or 0), np.float32)),
            "store_correct": flags,
            "store_rows": rows,
            "store_fitted_upto": np.array([e.fitted_upto for e in entries], np.int64),
        }

    @classmethod
    def load_snapshot(cls, path: str | os.PathLike) -> ErrorMemory:
        arrays, meta = FORMAT.load_npz(path)
        s = check(arrays, _SNAPSHOT_STORES, len(meta["keys"]), str(path))
        ranges = row_ranges(s["store_rows"], str(path))
        rows = check(arrays, _SNAPSHOT_ROWS, int(s["store_rows"].sum()), str(path))
        stores = zip(meta["keys"], s["store_correct"].tolist(), s["store_fitted_upto"].tolist(), ranges, strict=True)
        entries = [
            {"key": key, "correct": correct, "features": rows["features"][r], "steps": rows["step"][r],
             "labels": rows["label"][r], "fitted_upto": upto}
            for key, correct, upto, r in stores
        ]  # fmt: skip
        mem = cls(cap_per_key=meta["cap_per_key"])
        mem.load_state_dict({**FORMAT.header(), "dim": meta["dim"], "entries": entries})
        return mem


load_snapshot = ErrorMemory.load_snapshot
