"""The MEDS memory with its clusters kept current: ``ErrorMemory`` plus background re-fits. Shaping
reads the labels so far (:meth:`labels_for`), then :meth:`insert` appends every rank's features and
submits the touched stores' re-fits, run during the update (docs/REFERENCE.md steps 4-5).
``refit_growth`` (beyond the reference; a fit costs more than linear time): re-fit only once the
rows added since the last fit reach that fraction of the rows fitted (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import numpy as np

from medsrl.features.clustering import fit_cluster_labels, top1_eigen_ratio
from medsrl.methods.meds.error_memory import ErrorMemory, MemoryEntry
from medsrl.methods.meds.refit import BackgroundRefitter

Store = tuple[str, bool]  # (prompt key, correct)


class ClusteredMemory:
    def __init__(
        self,
        cap_per_key: int | None = None,
        refit: str = "background",
        refit_workers: int = 1,
        min_cluster_size: int = 2,
        min_samples: int = 1,
        refit_growth: float = 0.0,
        dedup: bool = False,
    ) -> None:
        if not refit_growth >= 0:
            raise ValueError(f"refit_growth must be >= 0, got {refit_growth}")
        self.refit_growth = float(refit_growth)
        self.memory = ErrorMemory(cap_per_key=cap_per_key)
        self._refit_args = dict(
            num_workers=refit_workers, mode=refit, min_cluster_size=min_cluster_size, min_samples=min_samples,
            fit_fn=functools.partial(fit_cluster_labels, dedup=True) if dedup else fit_cluster_labels,
        )
        self.refitter: BackgroundRefitter | None = None
        self._waits_seen = 0

    def open(self) -> None:
        if self.refitter is None:
            self.refitter = BackgroundRefitter(**self._refit_args)

    def drain(self) -> None:
        """Apply every pending re-fit (before saving: a resumed run sees the same labels)."""
        if self.refitter is not None:
            self._apply(self.refitter.drain())

    def close(self) -> None:
        self.drain()
        if self.refitter is not None:
            self.refitter.close()
            self.refitter = None

    def reset(self) -> None:
        if self.refitter is not None:
            self.refitter.drain()
        self.memory.reset()

    def labels_for(self, key: str, correct: bool) -> MemoryEntry | None:
        """The store with up-to-date labels (waits for a running re-fit)."""
        self._collect(key, correct)
        return self.memory.get(key, correct)

    def _collect(self, key: str, correct: bool) -> None:
        labels = self.refitter.wait((key, bool(correct))) if self.refitter is not None else None
        if labels is not None:
            self.memory.set_labels(key, correct, labels)

    def _apply(self, results: dict) -> None:
        for (key, correct), labels in results.items():
            if (entry := self.memory.get(key, correct)) is not None and len(labels) == len(entry):
                self.memory.set_labels(key, correct, labels)

    def insert(self, rows: list[tuple[list[Store], np.ndarray]], step: int) -> list[Store]:
        """Append every rank's ``(stores, features)`` rows in order; returns the stores touched."""
        self.open()
        by_store: dict[Store, list[np.ndarray]] = {}
        for stores, x in rows:
            for j, store in enumerate(stores):
                by_store.setdefault(store, []).append(x[j])
        for (key, ok), vecs in by_store.items():
            self._collect(key, ok)  # a running re-fit of this store must land before the add
            self.memory.add(key, ok, np.stack(vecs), step)
            entry = self.memory.get(key, ok)
            if len(entry) - entry.fitted_upto >= self.refit_growth * entry.fitted_upto:
                self.refitter.submit((key, ok), entry.features)
        self._apply(self.refitter.collect())
        return list(by_store)

    def metrics(self, touched: list[Store]) -> dict[str, float]:
        stats = self.refitter.stats if self.refitter is not None else {"blocked_waits": 0, "blocked_seconds": 0.0}
        out = {
            "memory_entries": float(self.memory.num_entries()),
            "memory_keys": float(self.memory.num_keys()),
            "refit_blocked_waits": float(stats["blocked_waits"] - self._waits_seen),
            "refit_blocked_seconds_total": float(stats["blocked_seconds"]),
        }
        self._waits_seen = stats["blocked_waits"]
        wrong = [self.memory.get(key, False) for key, ok in touched if not ok]
        ratios = [top1_eigen_ratio(entry.features) for entry in wrong if len(entry) >= 2]
        if not all(np.isnan(ratios)):  # all rows alike in every store: no spread to report
            out["top1_eigen_ratio"] = float(np.nanmean(ratios))
        return out
