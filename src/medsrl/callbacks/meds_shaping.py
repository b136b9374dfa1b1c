"""MEDS reward shaping: a response that repeats a frequent past mistake of its prompt loses
``min(alpha * ln(|C| + 1), beta)`` of its score before group normalisation (PAPER.md 4, 6, 7).

The cluster of a new response is predicted from the labels already stored for its
``(prompt key, correctness)`` (k-NN vote, cosine); responses of the same step do not count each
other. ``train/reward`` keeps logging the raw reward; advantages use the shaped ``scores``.
"""

from __future__ import annotations

import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from medsrl.callbacks.error_memory import ErrorMemoryCallback
from medsrl.callbacks.logit_capture import FEATURES, SAMPLE_INDEX
from medsrl.callbacks.protocol import RolloutCallback, StepRollouts
from medsrl.shaping.clustering import cluster_sizes, predict_labels, single_cluster_sizes
from medsrl.shaping.penalty import advantage_order_changed, apply_penalty, meds_penalty


class MedsShaping(RolloutCallback):
    """Changes ``rollouts.scores``; needs an ``ErrorMemoryCallback`` later in the callback list."""

    def __init__(
        self,
        alpha: float = 0.1,
        beta: float | None = None,
        target: str = "wrong",
        noise_is_cluster: bool = True,
        k: int = 3,
        mode: str = "cluster",
        panels_every_n_steps: int = 10,
        panel_prompts: int = 3,
    ) -> None:
        self.alpha, self.beta, self.target = alpha, beta, target
        self.noise_is_cluster, self.k, self.mode = noise_is_cluster, k, mode
        self.panels_every_n_steps = panels_every_n_steps
        self.panel_prompts = panel_prompts
        self._memory: ErrorMemoryCallback | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        found = [cb for cb in trainer.callbacks if isinstance(cb, ErrorMemoryCallback)]
        order = trainer.callbacks.index
        if not found or order(found[0]) < order(self):
            raise RuntimeError("MedsShaping needs an ErrorMemoryCallback after it in trainer.callbacks")
        self._memory = found[0]

    def cluster_sizes_for(self, rollouts: StepRollouts) -> tuple[np.ndarray, np.ndarray]:
        """Predicted cluster size and label per featured response, from the memory so far."""
        feats = rollouts.features[FEATURES].numpy()
        rows = rollouts.features[SAMPLE_INDEX].tolist()
        keys = rollouts.keys
        correct = (rollouts.acc > 0.5).tolist()
        sizes = np.zeros(len(rows), dtype=np.int64)
        labels = np.full(len(rows), -1, dtype=np.int64)
        by_store: dict[tuple[str, bool], list[int]] = {}
        for j, i in enumerate(rows):
            by_store.setdefault((keys[i], bool(correct[i])), []).append(j)
        for (key, ok), js in by_store.items():
            if not self._targeted(ok):
                continue
            entry = self._memory.labels_for(key, ok)
            if entry is None:
                continue  # first visit: size 0, the step only fills memory
            if self.mode == "single":
                sizes[js] = single_cluster_sizes(len(entry), len(js))
                continue
            pred = predict_labels(entry.fitted_features, entry.fitted_labels, feats[js], k=self.k)
            labels[js] = pred
            sizes[js] = cluster_sizes(entry.fitted_labels, pred, noise_is_cluster=self.noise_is_cluster)
        return sizes, labels

    def _targeted(self, correct: bool) -> bool:
        return {"wrong": not correct, "right": correct, "both": True, "none": False}[self.target]

    def on_rollouts_scored(self, trainer, module, rollouts: StepRollouts) -> None:
        sizes, labels = self.cluster_sizes_for(rollouts)
        rows = rollouts.features[SAMPLE_INDEX]
        pen = torch.zeros(len(rollouts), dtype=rollouts.scores.dtype)
        pen[rows] = torch.as_tensor(meds_penalty(sizes, self.alpha, self.beta), dtype=pen.dtype)
        correct = rollouts.acc > 0.5
        raw = rollouts.scores
        rollouts.scores = apply_penalty(raw, correct, pen, self.target)
        hit = pen > 0
        rollouts.metrics.update(
            {
                "meds/penalty_mean": float(pen.mean()),
                "meds/penalty_max": float(pen.max()) if len(pen) else 0.0,
                "meds/penalised_frac": float(hit.float().mean()),
                "meds/order_changed_group_frac": advantage_order_changed(raw, rollouts.scores, rollouts.group_ids),
                "meds/cluster_size_mean": float(sizes.mean()) if len(sizes) else 0.0,
            }
        )
        every = self.panels_every_n_steps
        if every and rollouts.step % every == 0 and trainer.is_global_zero:
            self._panels(trainer, rollouts, sizes, labels)

    def _panels(self, trainer, rollouts: StepRollouts, sizes: np.ndarray, labels: np.ndarray) -> None:
        """Histogram of predicted cluster sizes; per prompt, the largest error cluster this step
        fell into, with two of its responses (what the model keeps getting wrong)."""
        tb = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not tb:
            return
        rows = rollouts.features[SAMPLE_INDEX].tolist()
        wrong = [j for j, i in enumerate(rows) if rollouts.acc[i] <= 0.5 and sizes[j] > 0]
        by_key: dict[int, list[int]] = {}
        for j in wrong:
            by_key.setdefault(int(rollouts.group_ids[rows[j]]), []).append(j)
        worst = sorted(by_key.items(), key=lambda kv: -max(sizes[j] for j in kv[1]))[: self.panel_prompts]
        blocks = []
        for g, js in worst:
            top = max(sizes[j] for j in js)
            members = [j for j in js if sizes[j] == top][:2]
            prompt = rollouts.prompts[g]
            answers = [rollouts.grades[rows[j]].extracted for j in members]
            body = "\n\n".join(
                "    " + rollouts.response_text[rows[j]][:800].replace("\n", "\n    ") for j in members
            )
            blocks.append(
                f"**{prompt.problem[:300]}** (gold `{prompt.answer}`): error cluster {labels[members[0]]}"
                f" of size {top}, answers {answers}\n\n{body}"
            )
        for writer in tb:
            if len(sizes):
                writer.add_histogram("meds/cluster_size", sizes, global_step=rollouts.step)
            if blocks:
                writer.add_text("meds/largest_error_clusters", "\n\n---\n\n".join(blocks), rollouts.step)
