"""MEDS error memory: per (prompt, correctness) the features of past responses and their labels.

One store per key ``(prompt_key, correct)`` (PAPER.md step 3): right and wrong responses are
kept apart. A store holds the features [N, D] (float32) in insertion order, the training step
each row was added at [N] (int64), and the cluster labels [N] (int64) from the last HDBSCAN
re-fit, which covered the first ``fitted_upto`` rows (rows after it are -1 until the next fit).
The reference store is unbounded; ``cap_per_key`` optionally keeps only the newest rows.

The memory survives restarts two ways: ``state_dict``/``load_state_dict`` (plain numpy/python,
for Lightning checkpoints) and ``snapshot``/``load_snapshot`` (one ``.npz`` a user can open
without this package, written atomically).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.utils.atomic_file import atomic_write

MemoryKey = tuple[str, bool]  # (prompt key, response was correct)

FORMAT = "medsrl.error_memory"
VERSION = 1


def _frozen(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


@dataclass
class MemoryEntry:
    """One store, as a value: arrays are read-only, and ``add``/``set_labels`` put a new entry
    in the memory rather than changing this one (an entry you hold stays as it was)."""

    features: np.ndarray  # [N, D] float32
    steps: np.ndarray  # [N] int64, the step each row was added at
    labels: np.ndarray  # [N] int64, -1 = noise or not yet fitted
    fitted_upto: int = 0  # labels[:fitted_upto] come from the last re-fit

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    @property
    def fitted_features(self) -> np.ndarray:
        """The rows the current labels were fitted on (what k-NN prediction should search)."""
        return self.features[: self.fitted_upto]

    @property
    def fitted_labels(self) -> np.ndarray:
        return self.labels[: self.fitted_upto]


class ErrorMemory:
    """Features of past responses, per ``(prompt_key, correct)``, with their cluster labels.

    All stores share one feature dimension D (fixed by the first ``add``); a feature of another
    dimension raises ``ValueError`` naming the key. ``cap_per_key`` (None = unbounded, the
    reference) drops the oldest rows of a store beyond the cap, keeping steps and labels aligned.
    """

    def __init__(self, cap_per_key: int | None = None) -> None:
        if cap_per_key is not None and cap_per_key < 1:
            raise ValueError(f"cap_per_key must be >= 1 or None, got {cap_per_key}")
        self.cap_per_key = cap_per_key
        self._dim: int | None = None
        self._stores: dict[MemoryKey, MemoryEntry] = {}

    # ------------------------------------------------------------------ access
    @property
    def dim(self) -> int | None:
        return self._dim

    def get(self, key: str, correct: bool) -> MemoryEntry | None:
        return self._stores.get((key, bool(correct)))

    def keys(self) -> list[MemoryKey]:
        """All ``(prompt_key, correct)`` stores, in the order they were first filled."""
        return list(self._stores)

    def items(self) -> Iterator[tuple[MemoryKey, MemoryEntry]]:
        return iter(self._stores.items())

    def num_entries(self) -> int:
        """Rows over all stores."""
        return sum(len(e) for e in self._stores.values())

    def num_keys(self) -> int:
        """Number of ``(prompt_key, correct)`` stores (a prompt seen right and wrong counts 2)."""
        return len(self._stores)

    def __contains__(self, key: MemoryKey) -> bool:
        return (key[0], bool(key[1])) in self._stores

    # ----------------------------------------------------------------- changes
    def _check_dim(self, d: int, key: str, correct: bool) -> None:
        if self._dim is not None and d != self._dim:
            raise ValueError(
                f"feature dim {d} for key {key!r} (correct={correct}) does not match the "
                f"memory's feature dim {self._dim}"
            )

    def add(self, key: str, correct: bool, features: np.ndarray, step: int) -> None:
        """Append ``features`` [m, D] to the ``(key, correct)`` store, all stamped ``step``."""
        correct = bool(correct)
        x = np.asarray(features, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"features for key {key!r} must be [m, D], got shape {x.shape}")
        self._check_dim(x.shape[1], key, correct)
        if x.shape[0] == 0:
            return
        if not np.isfinite(x).all():
            raise ValueError(f"features for key {key!r} (correct={correct}) contain NaN or inf")
        self._dim = x.shape[1]
        m = x.shape[0]
        old = self._stores.get((key, correct))
        if old is None:
            feats, steps, labels, upto = x, np.full(m, step, np.int64), np.full(m, -1, np.int64), 0
        else:
            feats = np.concatenate([old.features, x])
            steps = np.concatenate([old.steps, np.full(m, step, np.int64)])
            labels = np.concatenate([old.labels, np.full(m, -1, np.int64)])
            upto = old.fitted_upto
        drop = 0 if self.cap_per_key is None else max(0, len(steps) - self.cap_per_key)
        self._stores[(key, correct)] = MemoryEntry(
            _frozen(np.array(feats[drop:])),
            _frozen(np.array(steps[drop:])),
            _frozen(np.array(labels[drop:])),
            max(0, upto - drop),
        )

    def set_labels(
        self, key: str, correct: bool, labels: np.ndarray, upto: int | None = None
    ) -> None:
        """Store the labels of a re-fit over the store's first ``upto`` rows (default: all
        ``len(labels)``). Rows after ``upto`` become -1 (not fitted yet).

        The labels must come from the rows as they are *now*: with a cap, a fit computed before
        a later ``add`` is misaligned (the oldest rows moved out), so re-fit after each add and
        collect the result before the key's next ``add`` (``BackgroundRefitter.wait``).
        """
        entry = self._stores.get((key, bool(correct)))
        if entry is None:
            raise KeyError(f"no memory for key {key!r} (correct={bool(correct)})")
        lab = np.asarray(labels, dtype=np.int64)
        upto = len(lab) if upto is None else int(upto)
        if lab.ndim != 1 or len(lab) != upto or not 0 <= upto <= len(entry):
            raise ValueError(
                f"labels of shape {lab.shape} with upto={upto} do not fit the {len(entry)} rows "
                f"stored for key {key!r} (correct={bool(correct)})"
            )
        new = np.full(len(entry), -1, np.int64)
        new[:upto] = lab
        self._stores[(key, bool(correct))] = replace(entry, labels=_frozen(new), fitted_upto=upto)

    def reset(self) -> None:
        self._stores.clear()
        self._dim = None

    # ------------------------------------------------------- checkpoint state
    def state_dict(self, *, as_tensors: bool = False) -> dict[str, Any]:
        """Plain python + numpy copy of the memory (exact: float32 features, int64 steps/labels).

        ``torch.load`` with its default ``weights_only=True`` refuses numpy arrays; pass
        ``as_tensors=True`` to get CPU tensors instead (``load_state_dict`` takes either).
        """

        def arr(x: np.ndarray):
            if not as_tensors:
                return x.copy()
            import torch

            return torch.from_numpy(x.copy())

        return {
            "format": FORMAT,
            "version": VERSION,
            "dim": self._dim,
            "cap_per_key": self.cap_per_key,
            "entries": [
                {
                    "key": key,
                    "correct": correct,
                    "features": arr(e.features),
                    "steps": arr(e.steps),
                    "labels": arr(e.labels),
                    "fitted_upto": int(e.fitted_upto),
                }
                for (key, correct), e in self._stores.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with ``state`` (from ``state_dict``), after validating it.

        The memory keeps its own ``cap_per_key`` (configuration, not state): stores longer than
        it are trimmed to their newest rows.
        """
        if state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ValueError(
                f"not an ErrorMemory state (format {state.get('format')!r}, version "
                f"{state.get('version')!r}; expected {FORMAT!r} version {VERSION})"
            )
        dim = state["dim"]
        stores: dict[MemoryKey, MemoryEntry] = {}
        for e in state["entries"]:
            key, correct = str(e["key"]), bool(e["correct"])
            where = f"key {key!r} (correct={correct})"
            feats = np.asarray(e["features"])
            steps, labels = np.asarray(e["steps"]), np.asarray(e["labels"])
            n, upto = len(steps), int(e["fitted_upto"])
            if feats.dtype != np.float32 or feats.ndim != 2 or feats.shape != (n, dim):
                raise ValueError(
                    f"{where}: features {feats.dtype}{feats.shape}, expected float32 ({n}, {dim})"
                )
            ints = all(np.issubdtype(a.dtype, np.integer) for a in (steps, labels))
            if not ints or steps.shape != (n,) or labels.shape != (n,) or not 0 <= upto <= n:
                raise ValueError(
                    f"{where}: steps {steps.dtype}{steps.shape}, labels {labels.dtype}{labels.shape} and fitted_upto "
                    f"{upto} do not match {n} rows"
                )
            if (key, correct) in stores:
                raise ValueError(f"{where} appears twice")
            drop = 0 if self.cap_per_key is None else max(0, n - self.cap_per_key)
            stores[(key, correct)] = MemoryEntry(
                _frozen(np.array(feats[drop:], dtype=np.float32)),
                _frozen(np.array(steps[drop:], dtype=np.int64)),
                _frozen(np.array(labels[drop:], dtype=np.int64)),
                max(0, upto - drop),
            )
        self._stores, self._dim = stores, (None if dim is None else int(dim))

    # ---------------------------------------------------------------- snapshot
    def snapshot(self, path: str | os.PathLike) -> Path:
        """Write the memory to one ``.npz`` file, atomically; returns the path.

        A crash mid-write leaves any previous file at ``path`` intact (``atomic_write``: a temp
        file in the same directory, fsync, ``os.replace``). Open it without medsrl::

            z = np.load(path)                     # no pickle needed
            meta = json.loads(str(z["meta"]))    # keys, dim, cap_per_key, per-store info
            df = pd.DataFrame({"key": np.array(meta["keys"], dtype=object)[z["store"]],
                               "correct": z["correct"], "step": z["step"], "label": z["label"]})
            df[[f"f{i}" for i in range(z["features"].shape[1])]] = z["features"]

        Arrays: per row ``store`` (index into ``meta["keys"]``), ``correct``, ``step``, ``label``,
        ``features`` [R, D]; rows are grouped by store in ``meta["keys"]`` order. Per store:
        ``store_correct``, ``store_rows``, ``store_fitted_upto``.
        """
        arrays = self._snapshot_arrays()
        return atomic_write(path, lambda f: _write_npz(f, arrays))

    def _snapshot_arrays(self) -> dict[str, np.ndarray]:
        entries = list(self._stores.items())
        dim = self._dim or 0
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dim": self._dim,
            "cap_per_key": self.cap_per_key,
            "keys": [key for (key, _), _ in entries],
        }
        rows = np.array([len(e) for _, e in entries], dtype=np.int64)

        def cat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
            return np.concatenate(parts) if parts else empty

        return {
            "meta": np.array(json.dumps(meta)),
            "store": np.repeat(np.arange(len(entries), dtype=np.int64), rows),
            "correct": np.repeat(np.array([c for (_, c), _ in entries], dtype=bool), rows),
            "step": cat([e.steps for _, e in entries], np.zeros(0, np.int64)),
            "label": cat([e.labels for _, e in entries], np.zeros(0, np.int64)),
            "features": cat([e.features for _, e in entries], np.zeros((0, dim), np.float32)),
            "store_correct": np.array([c for (_, c), _ in entries], dtype=bool),
            "store_rows": rows,
            "store_fitted_upto": np.array([e.fitted_upto for _, e in entries], dtype=np.int64),
        }

    @classmethod
    def load_snapshot(cls, path: str | os.PathLike) -> ErrorMemory:
        """Rebuild a memory (including its ``cap_per_key``) from a ``snapshot`` file."""
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not an ErrorMemory snapshot")
            bounds = np.concatenate([[0], np.cumsum(z["store_rows"])])
            feats, step, label = z["features"], z["step"], z["label"]
            dim = meta["dim"]
            entries = [
                {
                    "key": key,
                    "correct": bool(z["store_correct"][i]),
                    "features": feats[bounds[i] : bounds[i + 1]].reshape(-1, dim or 0),
                    "steps": step[bounds[i] : bounds[i + 1]],
                    "labels": label[bounds[i] : bounds[i + 1]],
                    "fitted_upto": int(z["store_fitted_upto"][i]),
                }
                for i, key in enumerate(meta["keys"])
            ]
        mem = cls(cap_per_key=meta["cap_per_key"])
        mem.load_state_dict(
            {"format": FORMAT, "version": meta["version"], "dim": dim, "entries": entries}
        )
        return mem


def load_snapshot(path: str | os.PathLike) -> ErrorMemory:
    """Module-level alias of ``ErrorMemory.load_snapshot``."""
    return ErrorMemory.load_snapshot(path)


def _write_npz(f, arrays: dict[str, np.ndarray]) -> None:
    """The one place the snapshot bytes are written (tests break it to check atomicity)."""
    np.savez(f, **arrays)
