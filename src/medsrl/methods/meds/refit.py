"""HDBSCAN re-fits off the step's critical path: a store's re-fit is needed only at its key's next
visit, so ``submit`` hands it to a worker and ``wait(key)`` blocks only if it still runs.
Processes, not threads: hdbscan holds the GIL throughout a fit (``benchmarks/cluster_refit.py``);
started by ``forkserver`` (no fork of CUDA state), they exit with their owner (``utils/lifetime.py``).
A worker that dies breaks the pool: its key is recomputed here with a warning, the other pending
keys go to a fresh pool (at most ``max_restarts`` times, then all in the main process).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import warnings
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Literal

import numpy as np

from medsrl.features.clustering import fit_cluster_labels
from medsrl.utils.lifetime import exit_with_owner, this_owner, without_main_import

FitFn = Callable[..., np.ndarray]


class RefitError(RuntimeError):
    """A re-fit raised; the message names the key."""


def _fit_job(features: np.ndarray, min_cluster_size: int, min_samples: int, fit_fn: FitFn) -> tuple[np.ndarray, float]:
    """What a worker runs: the labels and the seconds the fit took."""
    t0 = time.perf_counter()
    labels = fit_fn(features, min_cluster_size=min_cluster_size, min_samples=min_samples)
    return np.asarray(labels, dtype=np.int64), time.perf_counter() - t0


def _warm_up() -> None:
    """Workers import hdbscan (a second or more) before the first ``wait``."""
    import hdbscan  # noqa: F401


@dataclass
class _Job:
    future: Future
    features: np.ndarray  # kept so a job can be recomputed if its worker dies


class BackgroundRefitter:
    """Runs ``fit_cluster_labels`` per key in workers (``mode="sync"``: inside ``submit``, the reference
    order; ``executor="thread"``: to compare); each result is handed out once."""

    def __init__(
        self,
        num_workers: int = 1,
        mode: Literal["background", "sync"] = "background",
        min_cluster_size: int = 2,
        min_samples: int = 1,
        *,
        executor: Literal["process", "thread"] = "process",
        fit_fn: FitFn = fit_cluster_labels,
        max_restarts: int = 2,
    ) -> None:
        self.executor_kind, self.num_workers = executor, num_workers
        self.max_restarts = max_restarts
        self._fit_args = (min_cluster_size, min_samples, fit_fn)
        self._pool: Executor | None = None
        self._restarts = 0
        self._local_only = mode == "sync"
        self._pending: dict[Hashable, _Job] = {}
        self._done: dict[Hashable, np.ndarray] = {}
        self.stats: dict[str, float] = {  # fits done, waits that blocked, and their seconds
            "submitted": 0, "replaced": 0, "completed": 0, "fit_seconds": 0.0,
            "blocked_waits": 0, "blocked_seconds": 0.0, "worker_failures": 0,
        }
        if not self._local_only:
            for _ in range(num_workers):
                self._submit(_warm_up)

    def _submit(self, fn: Callable, *args) -> Future:
        with without_main_import():  # the pool starts its workers in submit
            return self._ensure_pool().submit(fn, *args)

    def _ensure_pool(self) -> Executor:
        if self._pool is None:
            if self.executor_kind == "thread":
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="refit")
            else:
                method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
                self._pool = ProcessPoolExecutor(self.num_workers, mp_context=mp.get_context(method),
                                                 initializer=exit_with_owner, initargs=(this_owner(),))
        return self._pool

    def _fit_here(self, key_id: Hashable, features: np.ndarray) -> np.ndarray:
        try:
            return self._record(_fit_job(features, *self._fit_args))
        except Exception as e:
            raise RefitError(f"HDBSCAN re-fit failed for key {key_id!r}: {e}") from e

    def _record(self, res: tuple[np.ndarray, float]) -> np.ndarray:
        labels, secs = res
        self.stats["completed"] += 1
        self.stats["fit_seconds"] += secs
        return labels

    def _start(self, key_id: Hashable, features: np.ndarray) -> Future | None:
        """Queue a fit in the pool; None when it must run here."""
        if self._local_only:
            return None
        try:
            return self._submit(_fit_job, features, *self._fit_args)
        except BrokenProcessPool:
            self._on_broken_pool()
            return self._start(key_id, features)

    def _on_broken_pool(self) -> None:
        """Drop the dead pool; re-queue pending jobs on a fresh one or go main-process only."""
        self.stats["worker_failures"] += 1
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._restarts += 1
        if self._restarts > self.max_restarts:
            self._local_only = True
            warnings.warn(f"re-fit worker pool broke {self._restarts} time(s), more than max_restarts="
                          f"{self.max_restarts}; clustering now runs in the main process", RuntimeWarning, stacklevel=3)
        for key_id, job in self._pending.items():
            if _lost(job.future):
                job.future = self._start(key_id, job.features) or _done_future(None)

    def _finish(self, key_id: Hashable, job: _Job) -> np.ndarray:
        try:
            res = job.future.result()
        except BrokenProcessPool:
            warnings.warn(f"re-fit worker process died while clustering key {key_id!r}; recomputing "
                          "that key in the main process", RuntimeWarning, stacklevel=3)
            self._on_broken_pool()
            res = None
        except Exception as e:
            raise RefitError(f"HDBSCAN re-fit failed for key {key_id!r}: {e}") from e
        if res is None:  # its worker died, or a placeholder: the pool was given up
            return self._fit_here(key_id, job.features)
        return self._record(res)

    def submit(self, key_id: Hashable, features: np.ndarray) -> None:
        """Schedule the re-fit of ``key_id`` on (a copy of) ``features`` [N, D]; the newest features win."""
        x = np.array(features, copy=True)
        self.stats["submitted"] += 1
        self._done.pop(key_id, None)
        old = self._pending.pop(key_id, None)
        if old is not None:
            old.future.cancel()
            self.stats["replaced"] += 1
        future = self._start(key_id, x)
        if future is None:
            self._done[key_id] = self._fit_here(key_id, x)
        else:
            self._pending[key_id] = _Job(future, x)

    def wait(self, key_id: Hashable) -> np.ndarray | None:
        """The labels of ``key_id``'s latest submit, once done; None if it has none not handed out."""
        job = self._pending.pop(key_id, None)
        if job is None:
            return self._done.pop(key_id, None)
        if not job.future.done():
            t0 = time.perf_counter()
            wait_futures([job.future])
            self.stats["blocked_waits"] += 1
            self.stats["blocked_seconds"] += time.perf_counter() - t0
        return self._finish(key_id, job)

    def collect(self) -> dict[Hashable, np.ndarray]:
        """All finished results not yet handed out."""
        for key_id in list(self._pending):
            job = self._pending.get(key_id)
            if job is not None and job.future.done():  # a broken pool may have re-queued it
                del self._pending[key_id]
                self._done[key_id] = self._finish(key_id, job)
        out, self._done = self._done, {}
        return out

    def drain(self) -> dict[Hashable, np.ndarray]:
        """Wait for every pending fit; returns all results not yet handed out."""
        while self._pending:  # a broken pool may re-queue jobs while we finish others
            key_id = next(iter(self._pending))
            job = self._pending.pop(key_id)
            wait_futures([job.future])
            self._done[key_id] = self._finish(key_id, job)
        return self.collect()

    def ready(self, key_id: Hashable) -> bool:
        job = self._pending.get(key_id)
        return job is None or job.future.done()

    def close(self) -> None:
        """Stop (and join) the workers; results not fetched are dropped."""
        for job in self._pending.values():
            job.future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> BackgroundRefitter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lost(future: Future) -> bool:
    """A future of a dead pool: cancelled by its shutdown, or failed with BrokenProcessPool."""
    if future.cancelled():  # before exception(), which raises for a cancelled future
        return True
    return future.done() and isinstance(future.exception(), BrokenProcessPool)


def _done_future(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
