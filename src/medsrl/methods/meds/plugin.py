"""MEDS as one plug-in: a wrong response that repeats a frequent past mistake of its prompt loses
``min(alpha * ln(|C| + 1), beta)`` of its score before group normalisation (docs/REFERENCE.md).

Per step: the scoring forward reads each response's answer feature, the k-NN vote over its store's
labels (earlier steps only) gives its cluster size and penalty, then every rank's features go into
the replicated memory. The gate figures (``gate.py``) are logged every step; the options beyond
the reference (``mode=answer``, ``dedup``, ``placement=advantage``): docs/MEDS.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from typing_extensions import Doc

from medsrl.algo import AdvantageInputs, advantage_change_fraction, compute_advantages, keep_mask_by_group_spread
from medsrl.features.clustering import NOISE, cluster_sizes, distinct_rows, predict_labels, single_cluster_sizes
from medsrl.features.reader import AnswerFeatureReader, FeatureSpec
from medsrl.methods.dynamic_sampling import DynamicSampling
from medsrl.methods.meds.clustered_memory import ClusteredMemory
from medsrl.methods.meds.diagnostics import cluster_answer_purity, penalty_on_top_answer
from medsrl.methods.meds.gate import (
    answer_counts_digest,
    common_penalty,
    correct_advantage_loss,
    count_answers,
    distinct_penalty_share,
    earlier_answer_counts,
    per_response,
    rewarded_error_share,
    size_recurrence_correlation,
    top_answer_excess,
)
from medsrl.methods.meds.penalty import TARGETS, advantage_order_changed, apply_penalty, meds_penalty, shuffle_penalties
from medsrl.models.sharding import idle_passes, is_sharded
from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import Count, Flag, NonNegative, PositiveInt, Settings, Text, at_least, nullable, one_of
from medsrl.step.balance import InStepOrder, in_step_order
from medsrl.step.rollouts import SAMPLED, StepRollouts
from medsrl.step.scoring import scoring_pass
from medsrl.utils.distributed import all_reduce_sum, is_distributed

log = logging.getLogger(__name__)


class ClusteringSettings(Settings):
    """How a response's cluster, and its size, are read from its store."""

    mode: one_of(("cluster", "single", "answer")) = "cluster"
    """cluster (reference) | single (ablation: the whole history is one cluster; on 0/1 rewards an
    exact no-op, docs/MEDS.md) | answer (beyond the reference: size = earlier count of the same
    extracted answer for the prompt; study v3's D1 bound)."""
    k: PositiveInt = 3
    """Neighbours in the k-NN vote (cosine) that predicts a response's cluster from the stored labels."""
    min_cluster_size: at_least(2) = 2
    """HDBSCAN's min_cluster_size."""
    min_samples: PositiveInt = 1
    """HDBSCAN's min_samples."""
    noise_is_cluster: Flag = True
    """HDBSCAN's noise points count as one cluster (reference), so a prompt whose errors never
    cluster still accumulates pressure; false: noise gets size 0."""
    dedup: Flag = False
    """Beyond the reference: HDBSCAN and the k-NN vote over a store's distinct rows (one step's
    identical responses are one point; sizes count every copy)."""


class MemorySettings(Settings):
    """What the memory keeps, and when its clusters are re-fitted."""

    cap_per_key: nullable(PositiveInt) = None
    """Rows kept per store (prompt key and correctness), oldest out; null: unbounded (reference)."""
    refit: one_of(("background", "sync")) = "background"
    """background (HDBSCAN re-fits in worker processes, off the step's critical path) | sync
    (reference order); same penalties."""
    refit_workers: PositiveInt = 1
    """Worker processes for background re-fits."""
    refit_growth: NonNegative = 0.0
    """0: re-fit a store after every add (reference); f: only once the rows added since its last
    fit reach f x the rows fitted (large stores: docs/BENCHMARKS.md)."""
    reset_on_stage_change: Flag = False
    """Empty the memory (and its answer counts) when the data's stage changes."""


class Meds(Plugin):
    """Memory-enhanced dynamic reward shaping. Defaults are the reference's choices."""

    name = "meds"
    # the flat keys of before, named by their new place when a config still sets one
    moved = {**{k: f"{group}.{k}" for group, schema in (("features", FeatureSpec), ("clustering", ClusteringSettings),
                                                         ("memory", MemorySettings)) for k in schema.model_fields},
             "feature_dtype": "features.dtype", "feature_logits": "features.logits"}

    def __init__(
        self,
        alpha: Annotated[NonNegative, Doc(
            "penalty scale; paper: 0.1 (Qwen3-1.7B, Qwen2.5-Math-7B), 0.02 (Qwen3-8B)")] = 0.1,
        beta: Annotated[nullable(NonNegative), Doc(
            "cap of the penalty min(alpha * ln(|C| + 1), beta); null: 2 * alpha (reference)")] = None,
        target: Annotated[one_of(TARGETS), Doc(
            "the responses the penalty applies to: wrong (reference) | right | both | none")] = "wrong",
        placement: Annotated[one_of(("score", "advantage")), Doc(
            "score (reference: the penalty before group normalisation, where its group mean cancels) "
            "| advantage (subtracted from wrong responses' advantages after normalisation, so the mean "
            "penalty survives; needs target=wrong)")] = "score",
        features: Annotated[FeatureSpec, Doc(
            "each response's answer feature, which the memory stores and clusters")] = FeatureSpec(),  # noqa: B008
        clustering: Annotated[ClusteringSettings, Doc(
            "a response's cluster and its size")] = ClusteringSettings(),  # noqa: B008 - never mutated
        memory: Annotated[MemorySettings, Doc(
            "the stores and their re-fits")] = MemorySettings(),  # noqa: B008 - never mutated
        mixed_groups_only: Annotated[Flag, Doc(
            "reference: groups all right / all wrong never reach MEDS (DAPO drops them); false: "
            "without dynamic sampling, shape and remember them too")] = True,
        remember_dropped: Annotated[Flag, Doc(
            "beyond the reference: also remember the groups DAPO's filter drops (a no-grad forward "
            "over them; never trained on), so an error a prompt makes in every sample costs when it "
            "next gives a mixed group")] = False,
        shuffle_penalties: Annotated[Flag, Doc(
            "control, beyond the reference: permute each step's penalties among each group's "
            "wrong responses (seeded by the run's seed and the step, the same on every rank): the "
            "penalty's distribution stays, its targeting goes")] = False,
        snapshot_every_n_steps: Annotated[Count, Doc(
            "write the memory to <snapshot_dir>/memory/memory.npz every N steps (rank 0); "
            "0: never")] = 20,
        panels_every_n_steps: Annotated[Count, Doc(
            "TensorBoard panels (cluster-size histogram, largest error clusters with two responses "
            "each) every N steps; 0: never")] = 10,
        panel_prompts: Annotated[Count, Doc(
            "prompts shown in the largest-error-clusters panel")] = 3,
        snapshot_dir: Annotated[nullable(Text), Doc(
            "where memory snapshots go; null: the run's log dir")] = None,
    ) -> None:
        if placement == "advantage" and target != "wrong":
            raise ValueError(f"meds.placement=advantage penalises wrong responses only; got target={target!r}")
        self.alpha, self.beta, self.target, self.placement = alpha, beta, target, placement
        # Hydra passes mappings: the same schemas turn them into settings
        self.features = FeatureSpec.model_validate(features)
        c = self.clustering = ClusteringSettings.model_validate(clustering)
        m = self.memory = MemorySettings.model_validate(memory)
        self.store = ClusteredMemory(m.cap_per_key, m.refit, m.refit_workers, c.min_cluster_size, c.min_samples,
                                     m.refit_growth, c.dedup)
        self.mixed_groups_only, self.remember_dropped = mixed_groups_only, remember_dropped
        self.shuffle_penalties = shuffle_penalties
        self._seed = 0  # the run's seed (setup): shuffle_penalties' draws
        self.snapshot_every_n_steps, self.snapshot_dir = snapshot_every_n_steps, snapshot_dir
        self.panels_every_n_steps, self.panel_prompts = panels_every_n_steps, panel_prompts
        self.reader: AnswerFeatureReader | None = None
        self._stage: str | None = None
        self._feats, self._rows = torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
        self._dropped, self._dropped_order = _NO_DROPPED, []  # DAPO's dropped rows and their places in the step
        self._read_sizes: list[int] = []  # sizes of the stores read this step (mechanism figures)
        self._read_labels: list[np.ndarray] = []  # fitted labels of the wrong stores read this step
        self._pen = torch.zeros(0)  # this step's penalty per response (placement=advantage)
        # per prompt key, how often each extracted answer was given by a remembered wrong response
        self.answer_counts: dict[str, dict[str, int]] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.reader is None:
            self.reader = AnswerFeatureReader(pl_module.policy, pl_module.tokenizer, self.features,
                                              pl_module.grader_cfg.reasoning_end)
        self._seed = pl_module.seed
        algo = self._algo = pl_module.algorithm  # the micro-batch budget of the dropped groups' forward
        self._budget = dict(micro_batch_size=algo.micro_batch_size, max_tokens=algo.max_tokens_per_microbatch)
        self.store.open()
        filtered = any(isinstance(p, DynamicSampling) for p in getattr(pl_module, "plugins", []))
        if self.remember_dropped and not filtered:
            log.warning("meds.remember_dropped=true without dynamic sampling: no group is dropped, "
                        "so it does nothing (meds.mixed_groups_only=false remembers every group)")
        if not filtered:
            log.info(
                "MEDS without dynamic sampling: groups whose responses are all right or all wrong are %s "
                "(meds.mixed_groups_only=%s; the reference never sees them)",
                "skipped" if self.mixed_groups_only else "shaped and remembered", self.mixed_groups_only,
            )

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self.store.close()

    def state_dict(self) -> dict:
        """Every pending re-fit applied first (tensors: loads with weights_only)."""
        self.store.drain()
        return {"memory": self.store.memory.state_dict(as_tensors=True), "stage": self._stage,
                "answer_counts": {k: dict(v) for k, v in self.answer_counts.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.store.memory.load_state_dict(state_dict["memory"])
        self._stage = state_dict.get("stage")
        self.answer_counts = {k: dict(v) for k, v in state_dict.get("answer_counts", {}).items()}

    def digest(self) -> str:
        return self.store.memory.digest() + answer_counts_digest(self.answer_counts)

    def before_scoring(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        self.enter_stage(rollouts.stage)
        self.reader.begin(rollouts.response_ids, rollouts.packed.prompt_length)

    def scoring_microbatch(self, rollouts: StepRollouts, rows):
        return self.reader.microbatch(rows, rollouts.packed.columns_end(rows))

    def after_scoring(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        feats, rows = self.reader.finish()  # the responses with an answer
        ctx.log(self, {"answer_found_rate": len(rows) / max(len(rollouts), 1)})
        if self.mixed_groups_only and len(rows):
            keep = keep_mask_by_group_spread(rollouts.acc, rollouts.group_ids)[rows]  # mixed groups
            ctx.log(self, {"skipped_rows": float((~keep).sum())})
            feats, rows = feats[keep], rows[keep]
        self._feats, self._rows = feats, rows
        self._dropped, self._dropped_order = _NO_DROPPED, []
        if self.remember_dropped and ctx.dropped:
            self._dropped = self.dropped_features(ctx.dropped, rollouts.packed.input_ids.device, ctx)
        elif self.remember_dropped and is_sharded(ctx.scoring_policy):
            idle_passes(ctx.scoring_policy)  # other ranks' DAPO filter may have dropped groups

    def dropped_features(self, groups: list, device, ctx: StepContext
                         ) -> tuple[list[tuple[str, bool]], np.ndarray, list[str | None]]:
        """``(key, correct)``, features and answers of DAPO's dropped groups, by a no-grad forward over them."""
        t0 = time.perf_counter()
        extra = StepRollouts.from_groups(groups, ctx.step, ctx.stage, self.reader.tokenizer.pad_token_id, device)
        self.reader.begin(extra.response_ids, extra.packed.prompt_length)
        scoring_pass(ctx.scoring_policy, extra.packed, **self._budget,
                     microbatch_context=lambda rows: self.reader.microbatch(rows, extra.packed.columns_end(rows)))
        feats, rows = self.reader.finish()
        correct = (extra.acc > 0.5).tolist()
        keys = [(extra.keys[i], bool(correct[i])) for i in rows.tolist()]
        answers = [extra.grades[i].extracted for i in rows.tolist()]
        self._dropped_order = _row_order(extra, rows.tolist(), lambda g: groups[g].origin, 1)
        ctx.log(self, {"dropped_rows_remembered": float(len(keys)),
                       "dropped_pass_s": time.perf_counter() - t0})
        return keys, feats.numpy(), answers

    def enter_stage(self, stage: str | None) -> None:
        """At a stage change, reset the memory (option) before anything reads it."""
        if self.memory.reset_on_stage_change and self._stage is not None and stage != self._stage:
            log.info("MEDS memory reset at stage change %s -> %s", self._stage, stage)
            self.store.reset()
            self.answer_counts = {}
        self._stage = stage

    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        sizes, labels = self.cluster_sizes_for(rollouts)
        pen = torch.zeros(len(rollouts), dtype=rollouts.scores.dtype)
        pen[self._rows] = torch.as_tensor(meds_penalty(sizes, self.alpha, self.beta), dtype=pen.dtype)
        if self.shuffle_penalties:
            pen = shuffle_penalties(pen, rollouts.group_ids, rollouts.acc > 0.5, self._rows,
                                    [p.key for p in rollouts.prompts], self._seed, rollouts.step)
        raw = rollouts.scores
        if self.placement == "score":
            rollouts.shape_scores(self.name, apply_penalty(raw, rollouts.acc > 0.5, pen, self.target))
        self._pen = pen
        ctx.log(self, {
            "penalty_mean": float(pen.mean()),
            "penalty_max": float(pen.max()) if len(pen) else 0.0,
            "penalised_frac": float((pen > 0).float().mean()),
            "order_changed_group_frac": advantage_order_changed(raw, rollouts.scores, rollouts.group_ids),
            "cluster_size_mean": float(sizes.mean()) if len(sizes) else 0.0,
            **self._figures(rollouts, sizes, labels, pen),
        })
        every = self.panels_every_n_steps
        if every and rollouts.step % every == 0:
            self._panels(rollouts, sizes, labels, ctx)

    def shape_advantages(self, rollouts: StepRollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``placement=advantage``: wrong responses lose their penalty here. Either way, gates G2, G5, G6."""
        pen = self._pen.to(device=advantages.device, dtype=advantages.dtype)
        wrong = (rollouts.acc <= 0.5).to(advantages.device)
        common_pen = common_penalty(pen, wrong, rollouts.group_ids.to(advantages.device))
        if self.placement == "advantage":
            base = advantages
            advantages = advantages - torch.where(wrong, pen, 0.0).view(-1, *[1] * (advantages.dim() - 1))
            common = base - torch.where(wrong, common_pen, 0.0).view(-1, *[1] * (advantages.dim() - 1))
        else:
            base = self._advantages_without_meds(rollouts)
            common = self._advantages_without_meds(rollouts, -torch.where(wrong, common_pen, 0.0))
        base, common, mask = base.to(advantages.device), common.to(advantages.device), rollouts.packed.response_mask
        out = {"g2_advantage_rewritten": advantage_change_fraction(advantages, base, mask),
               "g2_common": advantage_change_fraction(common, base, mask),
               "g2_targeted": advantage_change_fraction(advantages, common, mask)}
        correct, groups = (rollouts.acc > 0.5).cpu(), rollouts.group_ids.cpu()
        shaped_r, base_r = (per_response(a.detach(), mask).cpu() for a in (advantages, base))
        out["g5_rewarded_errors"] = rewarded_error_share(shaped_r, correct, groups)
        out["g6_correct_advantage_loss"] = correct_advantage_loss(shaped_r, base_r, correct, groups)
        ctx.log(self, _present(out, "gate/"))
        return advantages

    def _advantages_without_meds(self, rollouts: StepRollouts, term: torch.Tensor | None = None) -> torch.Tensor:
        """The run's advantages had MEDS added ``term`` (None: nothing) instead of its own to the scores."""
        delta = rollouts.terms.get(self.name)
        scores = rollouts.scores if delta is None else rollouts.scores - delta
        if term is not None:
            scores = scores + term.to(device=scores.device, dtype=scores.dtype)
        terms = {k: v for k, v in rollouts.terms.items() if k != self.name}
        inputs = AdvantageInputs(scores, rollouts.group_ids, terms, rollouts.packed.response_mask,
                                 reduce_sum=all_reduce_sum if is_distributed() else None)
        return compute_advantages(self._algo.advantage, inputs, **self._algo.advantage_options)

    def _figures(self, rollouts: StepRollouts, sizes: np.ndarray, labels: np.ndarray,
                 pen: torch.Tensor) -> dict[str, float]:
        """Clusters and noise of the wrong stores read (from the labels shaping used: after ``insert`` they would
        depend on whether a background re-fit had landed), the mean size of the stores read (0 on a first
        visit), where the penalty landed (``diagnostics.py``) and gates G1, G3, G4 (``gate.py``)."""
        read = [lab for lab in self._read_labels if len(lab)]
        store = {"clusters_per_key": float(np.mean([len(set(lab.tolist()) - {NOISE}) for lab in read])),
                 "noise_fraction": float(np.mean([np.mean(lab == NOISE) for lab in read]))} if read else {}
        groups, wrong, pens = rollouts.group_ids.tolist(), (rollouts.acc <= 0.5).tolist(), pen.tolist()
        answers = [g.extracted for g in rollouts.grades]
        rows = self._rows.tolist()
        on_top, top_share = penalty_on_top_answer(groups, wrong, answers, pens)
        out = _present({
            "entries_per_read": float(np.mean(self._read_sizes)) if self._read_sizes else 0.0,
            "cluster_answer_purity": cluster_answer_purity([groups[i] for i in rows], labels.tolist(),
                                                           [answers[i] for i in rows]),
            "penalty_on_top_answer": on_top,
            "top_answer_wrong_share": top_share,
        })
        featured = [(j, i) for j, i in enumerate(rows) if wrong[i]]
        counts = earlier_answer_counts([rollouts.keys[i] for _, i in featured],
                                       [answers[i] for _, i in featured], self.answer_counts)
        gate = {"g1_distinct_penalty_groups": distinct_penalty_share(groups, wrong, pens),
                "g3_group_top_answer_excess": top_answer_excess(groups, wrong, answers, pens),
                "g4_size_recurrence_corr": size_recurrence_correlation(
                    [groups[i] for _, i in featured], [sizes[j] for j, _ in featured], counts)}
        return {**store, **out, **_present(gate, "gate/")}

    def cluster_sizes_for(self, rollouts: StepRollouts) -> tuple[np.ndarray, np.ndarray]:
        """Predicted cluster size and label per featured response, from the memory so far."""
        feats, rows = self._feats.numpy(), self._rows.tolist()
        keys, correct = rollouts.keys, (rollouts.acc > 0.5).tolist()
        sizes = np.zeros(len(rows), dtype=np.int64)
        labels = np.full(len(rows), -1, dtype=np.int64)
        by_store: dict[tuple[str, bool], list[int]] = {}
        for j, i in enumerate(rows):
            by_store.setdefault((keys[i], bool(correct[i])), []).append(j)
        self._read_sizes, self._read_labels = [], []
        answers = [g.extracted for g in rollouts.grades]
        for (key, ok), js in by_store.items():
            if not _targeted(self.target, ok):
                continue
            entry = self.store.labels_for(key, ok)
            self._read_sizes.append(0 if entry is None else len(entry))
            if entry is None:
                continue  # first visit: size 0, the step only fills memory
            if not ok:
                self._read_labels.append(entry.fitted_labels)
            if self.clustering.mode == "answer":  # the answer-keyed memory: earlier count of the same answer
                history = self.answer_counts if not ok else {}
                sizes[js] = earlier_answer_counts([key] * len(js), [answers[rows[j]] for j in js], history)
                continue
            if self.clustering.mode == "single":
                sizes[js] = single_cluster_sizes(len(entry), len(js))
                continue
            stored, stored_labels = entry.fitted_features, entry.fitted_labels
            if self.clustering.dedup:  # the vote among distinct rows; sizes still count every copy
                first, _ = distinct_rows(stored)
                stored, stored_labels = stored[first], stored_labels[first]
            pred = predict_labels(stored, stored_labels, feats[js], k=self.clustering.k)
            labels[js] = pred
            sizes[js] = cluster_sizes(entry.fitted_labels, pred, noise_is_cluster=self.clustering.noise_is_cluster)
        return sizes, labels

    def step_additions(self, rollouts: StepRollouts, ctx: StepContext):
        """The features of this step's sampled responses (``remember_dropped``: and DAPO's dropped
        ones); R3's replays entered the memory in the step that sampled them."""
        keys, correct = rollouts.keys, (rollouts.acc > 0.5).tolist()
        fresh = [j for j, i in enumerate(self._rows.tolist()) if rollouts.source[i] == SAMPLED]
        rows = self._rows[fresh].tolist()
        added, feats = [(keys[i], bool(correct[i])) for i in rows], self._feats[fresh].numpy()
        answers = [rollouts.grades[i].extracted for i in rows]
        order = _row_order(rollouts, rows, lambda g: rollouts.group_index[g] if rollouts.group_index else None, 0)
        dropped_keys, dropped_feats, dropped_answers = self._dropped
        if dropped_keys:
            feats = np.concatenate([feats, dropped_feats]) if added else dropped_feats
            added, answers = added + dropped_keys, answers + dropped_answers
            order = order + self._dropped_order
        # per row, with its place in the step: commit applies every rank's rows as one process would
        return InStepOrder(zip(added, feats, answers, strict=True), order)

    def commit(self, additions, ctx: StepContext) -> None:
        """Every rank's rows into the memory in the step's order (``step/balance.py``), as one process would."""
        rows = in_step_order(additions)
        added = [key_ok for key_ok, _, _ in rows]
        feats = np.stack([f for _, f, _ in rows]) if rows else np.zeros((0, 0), np.float32)
        touched = self.store.insert([(added, feats)] if rows else [], ctx.step)
        count_answers(self.answer_counts, [(key, answer) for (key, ok), _, answer in rows if not ok])
        ctx.log(self, self.store.metrics(touched))
        every = self.snapshot_every_n_steps
        if every and (ctx.step + 1) % every == 0 and ctx.run_dir is not None:  # rank 0 writes
            path = Path(self.snapshot_dir or ctx.run_dir) / "memory" / "memory.npz"
            self.store.memory.snapshot(path)
            log.info("MEDS memory snapshot at step %d: %s (%d entries)", ctx.step, path,
                     self.store.memory.num_entries())

    def _panels(self, rollouts: StepRollouts, sizes: np.ndarray, labels: np.ndarray, ctx: StepContext) -> None:
        """Cluster sizes; per prompt, the largest error cluster hit this step, with two of its responses."""
        rows = self._rows.tolist()
        wrong = [j for j, i in enumerate(rows) if rollouts.acc[i] <= 0.5 and sizes[j] > 0]
        by_group: dict[int, list[int]] = {}
        for j in wrong:
            by_group.setdefault(int(rollouts.group_ids[rows[j]]), []).append(j)
        worst = sorted(by_group.items(), key=lambda kv: -max(sizes[j] for j in kv[1]))[: self.panel_prompts]
        blocks = []
        for g, js in worst:
            top = max(sizes[j] for j in js)
            members = [j for j in js if sizes[j] == top][:2]
            prompt = rollouts.prompts[g]
            answers = [rollouts.grades[rows[j]].extracted for j in members]
            body = "\n\n".join("    " + rollouts.response_text[rows[j]][:800].replace("\n", "\n    ") for j in members)
            blocks.append(f"**{prompt.problem[:300]}** (gold `{prompt.answer}`): error cluster {labels[members[0]]}"
                          f" of size {top}, answers {answers}\n\n{body}")
        if len(sizes):
            ctx.histogram(self, "cluster_size", sizes)
        if blocks:
            ctx.text(self, "largest_error_clusters", "\n\n---\n\n".join(blocks))


_NO_DROPPED: tuple[list[tuple[str, bool]], np.ndarray, list[str | None]] = ([], np.zeros((0, 0), np.float32), [])


def _targeted(target: str, correct: bool) -> bool:
    return {"wrong": not correct, "right": correct, "both": True, "none": False}[target]


def _present(values: dict, prefix: str = "") -> dict[str, float]:
    return {prefix + k: float(v) for k, v in values.items() if v is not None}


def _row_order(rollouts: StepRollouts, rows: list[int], place, tier: int) -> list:
    """Per row, ``(tier, place(its group), its row in the group)``: the batch's rows (tier 0) before
    the dropped ones (tier 1); None where its group has no place (rank order, ``step/balance.py``)."""
    groups = rollouts.group_ids.tolist()
    first: dict[int, int] = {}
    for i, g in enumerate(groups):
        first.setdefault(g, i)
    return [None if (at := place(groups[i])) is None else (tier, at, i - first[groups[i]]) for i in rows]
