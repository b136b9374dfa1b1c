"""The MEDS memory as a Lightning callback: insert each step's features, re-fit HDBSCAN off the
critical path, checkpoint the memory, and snapshot it for users.

Order inside a step (PAPER.md steps 4-5): the shaping callback reads labels stored so far
(``labels_for``), then this callback appends the step's features and submits each touched key's
re-fit to a background worker. The re-fit is needed only when the key comes back, so the policy
update runs meanwhile; ``labels_for`` waits for a key only if its re-fit is still running.

Several processes: each rank scores its own prompts, but the memory is replicated. Every step the
ranks all-gather the new (key, correctness, feature) rows and insert all of them in rank order, so
every rank holds the same memory, re-fits the same clusters and computes the penalties one
process would. Rank 0 writes the snapshots; the checkpoint (written by rank 0) holds it once; at
each snapshot step the ranks compare memory digests and stop with an error if they ever differ.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from medsrl.callbacks.logit_capture import FEATURES, SAMPLE_INDEX
from medsrl.callbacks.protocol import RolloutCallback, StepRollouts, run_log_dir
from medsrl.shaping.clustering import NOISE, top1_eigen_ratio
from medsrl.shaping.memory import ErrorMemory, MemoryEntry
from medsrl.shaping.refit import BackgroundRefitter
from medsrl.utils.distributed import all_gather_objects

log = logging.getLogger(__name__)


class ErrorMemoryCallback(RolloutCallback):
    """Owns the per-(prompt key, correctness) feature memory and its re-fits."""

    def __init__(
        self,
        cap_per_key: int | None = None,
        refit: str = "background",
        refit_workers: int = 1,
        min_cluster_size: int = 2,
        min_samples: int = 1,
        reset_on_stage_change: bool = False,
        snapshot_every_n_steps: int = 20,
        snapshot_dir: str | None = None,
    ) -> None:
        self.memory = ErrorMemory(cap_per_key=cap_per_key)
        self.refit_mode = refit
        self.refit_workers = refit_workers
        self.min_cluster_size = min_cluster_size
        self.min_samples = min_samples
        self.reset_on_stage_change = reset_on_stage_change
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.snapshot_dir = snapshot_dir
        self.refitter: BackgroundRefitter | None = None
        self._stage: str | None = None
        self._waits_seen = 0

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.refitter is None:
            self.refitter = BackgroundRefitter(
                num_workers=self.refit_workers,
                mode=self.refit_mode,
                min_cluster_size=self.min_cluster_size,
                min_samples=self.min_samples,
            )

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.refitter is not None and stage == "fit":
            self._apply(self.refitter.drain())
            self.refitter.close()
            self.refitter = None

    def state_dict(self) -> dict:
        """The whole memory with every pending re-fit applied, so a resumed run sees the labels
        an uninterrupted one would."""
        if self.refitter is not None:
            self._apply(self.refitter.drain())
        # tensors, not numpy arrays: checkpoints must load with torch.load(weights_only=True)
        return {"memory": self.memory.state_dict(as_tensors=True), "stage": self._stage}

    def load_state_dict(self, state_dict: dict) -> None:
        self.memory.load_state_dict(state_dict["memory"])
        self._stage = state_dict.get("stage")

    # ------------------------------------------------------------------ reading

    def labels_for(self, key: str, correct: bool) -> MemoryEntry | None:
        """The ``(key, correct)`` store with up-to-date labels (waits for a running re-fit)."""
        self._collect(key, correct)
        return self.memory.get(key, correct)

    def _collect(self, key: str, correct: bool) -> None:
        if self.refitter is None:
            return
        labels = self.refitter.wait((key, bool(correct)))
        if labels is not None:
            self.memory.set_labels(key, correct, labels)

    def _apply(self, results: dict) -> None:
        for (key, correct), labels in results.items():
            if (key, correct) in self.memory and len(labels) == len(self.memory.get(key, correct)):
                self.memory.set_labels(key, correct, labels)

    # ------------------------------------------------------------------ writing

    def on_before_logprob_forward(self, trainer, module, rollouts: StepRollouts) -> None:
        """Stage change: reset the memory first (option), before anything reads it this step."""
        if self.reset_on_stage_change and rollouts.stage != self._stage and self._stage is not None:
            log.info("MEDS memory reset at stage change %s -> %s", self._stage, rollouts.stage)
            if self.refitter is not None:
                self.refitter.drain()
            self.memory.reset()
        self._stage = rollouts.stage

    def on_rollouts_scored(self, trainer, module, rollouts: StepRollouts) -> None:
        feats = rollouts.features.get(FEATURES)
        if feats is None:
            raise RuntimeError("ErrorMemoryCallback needs AnswerLogitCapture before it in callbacks")
        rows = rollouts.features[SAMPLE_INDEX].tolist()
        keys = rollouts.keys
        correct = (rollouts.acc > 0.5).tolist()
        local = ([(keys[i], bool(correct[i])) for i in rows], feats.numpy())
        by_store: dict[tuple[str, bool], list[np.ndarray]] = {}
        for stores, x in all_gather_objects(local):  # every rank's new rows, in rank order
            for j, store in enumerate(stores):
                by_store.setdefault(store, []).append(x[j])
        for (key, ok), vecs in by_store.items():
            self._collect(key, ok)  # a running re-fit of this key must land before the add
            self.memory.add(key, ok, np.stack(vecs), rollouts.step)
            self.refitter.submit((key, ok), self.memory.get(key, ok).features)
        self._apply(self.refitter.collect())
        rollouts.metrics.update(self._metrics([k for k in by_store if not k[1]]))
        if self.snapshot_every_n_steps and (rollouts.step + 1) % self.snapshot_every_n_steps == 0:
            self.check_replicas(rollouts.step)
            self.snapshot(trainer, rollouts.step)

    def digest(self) -> str:
        """A hash of every stored key, feature and step: equal on all ranks of a healthy run.

        (Labels are left out: a re-fit may have landed on one rank and not yet on another; they
        are a deterministic function of the features.)
        """
        h = hashlib.sha1()
        for entry in self.memory.state_dict()["entries"]:
            h.update(f"{entry['key']}|{entry['correct']}|".encode())
            h.update(np.ascontiguousarray(entry["features"]).tobytes())
            h.update(np.ascontiguousarray(entry["steps"]).tobytes())
        return h.hexdigest()

    def check_replicas(self, step: int) -> None:
        """Raise if the ranks' memories differ (they never should; this catches it early)."""
        digests = all_gather_objects(self.digest())
        if len(set(digests)) > 1:
            raise RuntimeError(f"step {step}: MEDS memory differs across ranks: {digests}")

    def snapshot(self, trainer, step: int) -> Path | None:
        """Write ``memory/memory.npz`` atomically (open with ``numpy.load``; see ErrorMemory)."""
        if not trainer.is_global_zero:
            return None
        root = Path(self.snapshot_dir or run_log_dir(trainer))
        path = root / "memory" / "memory.npz"
        self.memory.snapshot(path)
        log.info("MEDS memory snapshot at step %d: %s (%d entries)", step, path, self.memory.num_entries())
        return path

    def _metrics(self, wrong_stores: list[tuple[str, bool]]) -> dict[str, float]:
        stats = self.refitter.stats
        out = {
            "meds/memory_entries": float(self.memory.num_entries()),
            "meds/memory_keys": float(self.memory.num_keys()),
            "meds/refit_blocked_waits": float(stats["blocked_waits"] - self._waits_seen),
            "meds/refit_blocked_seconds_total": float(stats["blocked_seconds"]),
        }
        self._waits_seen = stats["blocked_waits"]
        clusters, noise, ratios = [], [], []
        for key, ok in wrong_stores:
            entry = self.memory.get(key, ok)
            lab = entry.fitted_labels
            if len(lab):
                clusters.append(len(set(lab.tolist()) - {NOISE}))
                noise.append(float(np.mean(lab == NOISE)))
            if len(entry) >= 2:
                ratios.append(top1_eigen_ratio(entry.features))
        if clusters:
            out["meds/clusters_per_key"] = float(np.mean(clusters))
            out["meds/noise_fraction"] = float(np.mean(noise))
        if ratios:
            out["meds/top1_eigen_ratio"] = float(np.nanmean(ratios))
        return out

