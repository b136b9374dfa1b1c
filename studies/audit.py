"""D1, an audit of MEDS's memory without RL: ``python -m studies.audit <run>``.

Does MEDS's per-prompt memory count how often a wrong answer recurs? The suspicion (study v3):
identical responses of one step have bit-identical features, every update moves the features, so
HDBSCAN finds many tiny clusters of one step's duplicates and a cluster's size says little about
how often an answer comes back. The audit measures it on the checkpoints of one short training run,
with no training at all:

1. **Prompts.** A fixed set of the run's level-1 training pool: ``traps`` traps and ``others``
   non-traps (``medsrl.data.precedence``), in pool order.
2. **Samples** (:func:`sample_all`). For each checkpoint in step order, the warm start (step 0)
   first, ``visits`` visits: every prompt sampled ``n`` times with the repo's HF rollout engine
   (the run's prompt template, temperature and ``max_new_tokens``), graded by ``MathGrader``, and
   the features of every response read with that checkpoint's weights, one forward per
   micro-batch, in every FEATURE variant of :data:`FEATURES`. Cached per visit under
   ``<out>/samples/`` (``stepSSSSSS_visitV.npz`` + ``.jsonl``): a re-run only reports, and one
   after the run saved more checkpoints samples only those. The visits of one checkpoint share
   its weights (training never meets a prompt twice with the same weights), so the figures of
   recurrence are given per checkpoint too.
3. **Replay** (:func:`replay`). Per feature variant and STORE variant (:data:`STORES`), each
   prompt's wrong responses, visit by visit, through the plug-in's own pure functions: predict
   the new rows' clusters from the store fitted so far (``clustering.predict_labels``, k=3; the
   first visit: size 0), their sizes and ``penalty.meds_penalty``; then add the visit's rows and
   re-fit (``clustering.fit_cluster_labels``).
4. **Figures** (:func:`variant_figures`): the gate's G1, G3, G4 (``methods.meds.gate``), the
   clusters each store holds after the last visit and how many visits they span, and how often
   a feature vector has a bit-identical twin in its visit or comes back in a later one, and the
   clusters' agreement with the responses' routes (:func:`route_agreement`, ``studies.routes``).

Outputs: ``<out>/audit.json`` (every figure, the settings, the checkpoints) and
``<out>/audit.md`` (one table). Not the plug-in's exact numbers: training scores rows in a
shared-prompt forward and meets each prompt about once per ``pool / prompts_per_step`` steps;
here every prompt is met at every visit, in a plain full-width forward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from medsrl.features.clustering import (
    NOISE,
    cluster_sizes,
    distinct_rows,
    fit_cluster_labels,
    predict_labels,
)
from medsrl.features.reader import FeatureSpec
from medsrl.methods.meds.gate import (
    distinct_penalty_share,
    earlier_answer_counts,
    size_recurrence_correlation,
    top_answer_excess,
)
from medsrl.methods.meds.penalty import meds_penalty
from medsrl.utils.atomic_file import atomic_write, atomic_write_text
from studies.routes import cluster_route_agreement, route_of

ROOT = Path(__file__).resolve().parents[1]

# FEATURE variants: a FeatureSpec is read by the plug-in's AnswerFeatureReader; None: the audit's
# own reader (:func:`two_token_targets`).
FEATURES: dict[str, FeatureSpec | None] = {
    "reference": FeatureSpec(),  # layers 14 (all 4 of the tiny model), fp32 on a fp32 policy
    "bf16": FeatureSpec(dtype="bfloat16"),
    "diff": FeatureSpec(diff=True),
    "final_norm": FeatureSpec(final_norm=True),
    "digits": FeatureSpec(logits="digits"),  # the ten digit tokens' logits at every layer
    "two_tokens": None,  # the reference feature of the first two answer tokens, concatenated
}
ANSWER_FEATURE = "-"  # the answer-keyed store reads no feature


@dataclass(frozen=True)
class StoreSpec:
    """One way to keep a prompt's wrong responses: ``features`` (the plug-in's store: HDBSCAN
    over feature rows; ``dedup``: the plug-in's ``meds.clustering.dedup``, HDBSCAN and the vote
    over the distinct rows, sizes counting every copy) or ``answer`` (a count per extracted answer, no
    features: the upper bound)."""

    name: str
    kind: str = "features"
    min_samples: int = 1
    dedup: bool = False


STORES: tuple[StoreSpec, ...] = (
    StoreSpec("reference"),
    StoreSpec("dedup", dedup=True),
    StoreSpec("min_samples=2", min_samples=2),
    StoreSpec("min_samples=3", min_samples=3),
    StoreSpec("answer", kind="answer"),
)
# the variants that are settings of the MEDS plug-in: what a study arm can take from the audit, as
# full keys (configs/plugins/meds.yaml); folders and labels name a key by its last part
# (studies.runner.setting_name: features.logits -> feature_logits, as before the groups)
MEDS = "algorithm.plugins.meds"
FEATURE_SETTINGS = {
    "reference": [],
    "bf16": [f"{MEDS}.features.dtype=bfloat16"],
    "diff": [f"{MEDS}.features.diff=true"],
    "digits": [f"{MEDS}.features.logits=digits"],
    "final_norm": [f"{MEDS}.features.final_norm=true"],
}
STORE_SETTINGS = {
    "reference": [],
    "dedup": [f"{MEDS}.clustering.dedup=true"],
    "min_samples=2": [f"{MEDS}.clustering.min_samples=2"],
    "min_samples=3": [f"{MEDS}.clustering.min_samples=3"],
}
ANSWER_SETTINGS = [f"{MEDS}.clustering.mode=answer"]  # the answer-keyed memory


def chosen_memory(audit: dict) -> tuple[str, list[str]]:
    """Protocol v3's rule for D2's third arm, from ``audit.json``: the feature-based variant with
    the highest G4 if its G4 >= 0.3 and G3 > 0, else the answer-keyed memory. Returns its name
    and its MEDS settings."""
    best = None
    for row in audit["variants"]:
        g3, g4 = row.get("G3"), row.get("G4")
        if row["store"] == "answer" or g3 is None or g4 is None:
            continue
        if g4 >= 0.3 and g3 > 0 and (best is None or g4 > best["G4"]):
            best = row
    if best is None:
        return "answer", list(ANSWER_SETTINGS)
    name = f"{best['feature']} feature, {best['store']} store"
    if best["feature"] not in FEATURE_SETTINGS or best["store"] not in STORE_SETTINGS:
        raise SystemExit(f"[study] D1 chose {name!r}, which is not a MEDS plug-in setting; build it "
                         "as an option before D2 (docs/STUDY.md, protocol v3)")
    return name, FEATURE_SETTINGS[best["feature"]] + STORE_SETTINGS[best["store"]]


def kept_memory(root: Path) -> tuple[str, list[str]]:
    """The chosen memory of the audit part in ``root``: made once by :func:`chosen_memory` and
    kept in ``choice.json``, so a later audit (a changed variant) cannot change the arm of a D2
    that already ran. One kept before MEDS's settings were grouped holds their flat keys
    (``dedup=true``), as its D2's ``study.json`` does; the runner maps them to their new places."""
    path = Path(root) / "choice.json"
    if path.is_file():
        choice = json.loads(path.read_text())
        return choice["name"], list(choice["settings"])
    name, settings = chosen_memory(json.loads((Path(root) / "audit" / "audit.json").read_text()))
    path.write_text(json.dumps({"name": name, "settings": settings}, indent=2) + "\n")
    return name, settings


@dataclass
class AuditSettings:
    """What decides the audit's numbers (sampling settings are checked against the cache)."""

    run: str = ""
    out: str = ""
    warm_start: str = "auto"  # auto: from the run's config; none: no step-0 policy; or a path
    visits: int = 2  # visits per checkpoint
    n: int = 16  # samples per prompt and visit
    traps: int = 24
    others: int = 8
    pool: int | None = None  # level-1 training pool size; None: the run's (study.pool_l1)
    seed: int = 0
    temperature: float | None = None  # None: the run's rollout.temperature (else 1.0)
    max_new_tokens: int | None = None  # None: the run's rollout.max_new_tokens (else 80)
    max_batch_size: int = 128  # sequences per generate call
    feature_batch: int = 128  # sequences per feature forward (whole prompts)
    max_checkpoints: int | None = None  # the first N checkpoints (warm start included); None: all
    threads: int = 1  # torch threads: the tiny model's ops are too small to split, and on a shared
    # machine a second thread spins against other jobs (50x slower measured on 2 busy cores)
    # replay (the plug-in's defaults, configs/plugins/meds.yaml)
    alpha: float = 0.1
    beta: float | None = None
    k: int = 3
    min_cluster_size: int = 2
    mixed_groups_only: bool = False  # true: as the plug-in, only groups with right and wrong rows
    features: list[str] = field(default_factory=lambda: list(FEATURES))

    def sampling_key(self) -> dict:
        """The settings the cached samples depend on."""
        keys = ("visits", "n", "traps", "others", "pool", "seed", "temperature", "max_new_tokens",
                "max_batch_size", "feature_batch", "features")
        return {k: getattr(self, k) for k in keys}


# ---------------------------------------------------------------------------------------------
# the stores (pure: numpy and the plug-in's clustering functions only)


class FeatureMemory:
    """One prompt's store of wrong features, as the plug-in keeps it (``ClusteredMemory`` with
    ``memory.refit_growth=0``: every add re-fits), through the plug-in's own functions. ``dedup``: the
    plug-in's ``meds.clustering.dedup`` (HDBSCAN and the vote over the store's distinct rows; a
    cluster's size still counts every copy)."""

    def __init__(self, *, min_cluster_size: int = 2, min_samples: int = 1, k: int = 3, dedup: bool = False):
        self.min_cluster_size, self.min_samples, self.k, self.dedup = min_cluster_size, min_samples, k, dedup
        self.rows: list[np.ndarray] = []
        self.visit: list[int] = []  # the visit each stored row was added at
        self.ids: list[int] = []  # the sample each stored row is
        self.labels = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def sizes(self, x: np.ndarray, answers: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
        """``(sizes, predicted labels)`` of query rows ``x`` from the store fitted so far (empty:
        size 0, label -1, as the plug-in on a prompt's first visit)."""
        q = len(x)
        if not self.rows or q == 0:
            return np.zeros(q, dtype=np.int64), np.full(q, NOISE, dtype=np.int64)
        stored, labels = np.stack(self.rows), self.labels
        if self.dedup:  # as Meds.cluster_sizes_for
            first, _ = distinct_rows(stored)
            stored, labels = stored[first], labels[first]
        pred = predict_labels(stored, labels, x, k=self.k)
        return cluster_sizes(self.labels, pred), pred

    def add(self, visit: int, x: np.ndarray, texts: Sequence[str], answers: Sequence[str | None],
            ids: Sequence[int]) -> None:
        """Append one visit's rows and re-fit (nothing added: the labels stand)."""
        if len(x) == 0:
            return
        self.rows.extend(np.asarray(x, dtype=np.float64))
        self.visit.extend([visit] * len(x))
        self.ids.extend(int(i) for i in ids)
        self.labels = fit_cluster_labels(np.stack(self.rows), min_cluster_size=self.min_cluster_size,
                                         min_samples=self.min_samples, dedup=self.dedup)

    def cluster_visits(self) -> list[list[int]]:
        """The visits of the rows of each cluster (noise is no cluster here)."""
        out: dict[int, list[int]] = defaultdict(list)
        for label, v in zip(self.labels.tolist(), self.visit, strict=True):
            if label != NOISE:
                out[label].append(v)
        return [out[c] for c in sorted(out)]

    def row_labels(self) -> dict[int, int]:
        """The fitted label of every sample the store holds."""
        return {i: int(label) for label, i in zip(self.labels.tolist(), self.ids, strict=True)}

    def noise_share(self) -> float:
        return float(np.mean(self.labels == NOISE)) if len(self.labels) else math.nan


class AnswerMemory:
    """One prompt's wrong answers with a count each, no features: a response's size is how often
    its answer was given wrong before (the bound a feature memory approximates). Its clusters are
    the answers given at least ``min_cluster_size`` times, to compare with HDBSCAN's."""

    def __init__(self, *, min_cluster_size: int = 2):
        self.min_cluster_size = min_cluster_size
        self.count: Counter = Counter()
        self.visits: dict[str, list[int]] = defaultdict(list)
        self.ids: dict[str, list[int]] = defaultdict(list)
        self.order: dict[str, int] = {}  # label of an answer: its order of first appearance

    def __len__(self) -> int:
        return sum(self.count.values())

    def sizes(self, x: np.ndarray | None, answers: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
        sizes = np.array([self.count.get(a, 0) if a is not None else 0 for a in answers], dtype=np.int64)
        labels = np.array([self.order.get(a, NOISE) for a in answers], dtype=np.int64)
        return sizes, labels

    def add(self, visit: int, x: np.ndarray | None, texts: Sequence[str], answers: Sequence[str | None],
            ids: Sequence[int]) -> None:
        for a, i in zip(answers, ids, strict=True):
            if a is None:
                continue
            self.order.setdefault(a, len(self.order))
            self.count[a] += 1
            self.visits[a].append(visit)
            self.ids[a].append(int(i))

    def _clusters(self) -> list[str]:
        return [a for a in self.order if self.count[a] >= self.min_cluster_size]

    def cluster_visits(self) -> list[list[int]]:
        return [self.visits[a] for a in self._clusters()]

    def row_labels(self) -> dict[int, int]:
        big = set(self._clusters())
        return {i: (self.order[a] if a in big else NOISE) for a, ids in self.ids.items() for i in ids}

    def noise_share(self) -> float:
        total = sum(self.count.values())
        small = sum(c for a, c in self.count.items() if c < self.min_cluster_size)
        return small / total if total else math.nan


def make_memory(store: StoreSpec, s: AuditSettings) -> FeatureMemory | AnswerMemory:
    if store.kind == "answer":
        return AnswerMemory(min_cluster_size=s.min_cluster_size)
    return FeatureMemory(min_cluster_size=s.min_cluster_size, min_samples=store.min_samples, k=s.k,
                         dedup=store.dedup)


# ---------------------------------------------------------------------------------------------
# the samples and their replay


@dataclass
class Samples:
    """Every graded response of the audit, one row each (visits in order, prompts in order)."""

    visit: np.ndarray  # [B] int: global visit index (checkpoint * visits + visit)
    prompt: np.ndarray  # [B] int: index into ``problems``
    correct: np.ndarray  # [B] bool
    answers: list[str | None]
    texts: list[str]
    features: dict[str, np.ndarray]  # variant -> [B, D] float32, NaN rows: no feature
    problems: list[str] = field(default_factory=list)
    visits_per_checkpoint: int = 1  # visit // this = the checkpoint (the weights) it sampled

    def __len__(self) -> int:
        return len(self.visit)

    @property
    def checkpoint(self) -> np.ndarray:
        return self.visit // self.visits_per_checkpoint

    def usable(self, feature: str, mixed_groups_only: bool = False) -> np.ndarray:
        """Rows a store of ``feature`` remembers and scores: wrong, with a feature (the answer
        store: with an answer), and with ``mixed_groups_only`` in a group with a right response."""
        wrong = ~self.correct
        if feature == ANSWER_FEATURE:
            ok = np.array([a is not None for a in self.answers], dtype=bool)
        else:
            ok = np.isfinite(self.features[feature]).all(axis=1)
        keep = wrong & ok
        if mixed_groups_only:
            groups = self.visit * (int(self.prompt.max()) + 1) + self.prompt
            mixed = {g for g in np.unique(groups) if self.correct[groups == g].any() and wrong[groups == g].any()}
            keep &= np.isin(groups, list(mixed))
        return keep


@dataclass
class Replay:
    """One (feature, store) replay: per row its size and predicted label (0 / -1 where not
    scored), which rows were scored, and the memories after the last visit."""

    sizes: np.ndarray
    labels: np.ndarray
    scored: np.ndarray
    memories: dict[int, FeatureMemory | AnswerMemory]


def replay(samples: Samples, feature: str, store: StoreSpec, s: AuditSettings) -> Replay:
    """Each prompt's wrong rows visit by visit: sizes from the store so far, then the add and
    re-fit, as the plug-in does at each of a prompt's steps."""
    n = len(samples)
    sizes, labels = np.zeros(n, dtype=np.int64), np.full(n, NOISE, dtype=np.int64)
    scored = samples.usable(feature, s.mixed_groups_only)
    x_all = None if feature == ANSWER_FEATURE else samples.features[feature].astype(np.float64)
    memories = {int(p): make_memory(store, s) for p in np.unique(samples.prompt)}
    for v in np.unique(samples.visit):
        for p, mem in memories.items():
            ids = np.flatnonzero(scored & (samples.visit == v) & (samples.prompt == p))
            x = None if x_all is None else x_all[ids]
            answers = [samples.answers[i] for i in ids]
            sizes[ids], labels[ids] = mem.sizes(x, answers)
            mem.add(int(v), x, [samples.texts[i] for i in ids], answers, ids)
    return Replay(sizes, labels, scored, memories)


# ---------------------------------------------------------------------------------------------
# the figures


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return float(np.mean(vals)) if vals else None


def gate_figures(samples: Samples, rep: Replay, alpha: float, beta: float | None) -> dict[str, Any]:
    """G1, G3 and G4 over the visits after the first (on the first every store is empty).

    Rows are the visit's responses; the wrong ones are those the store scored (others carry no
    penalty and are left out of ``wrong``, so the figures see the memory alone); group = prompt.
    G3 is the mean of the per-visit values (the plug-in logs it per step); G1 and G4 pool every
    (visit, prompt) group in one call (G1: a share of groups; G4: row-weighted within groups).
    G4's counts: the prompt's wrong answers (all wrong responses with one) at earlier visits.
    """
    pen = np.zeros(len(samples))
    pen[rep.scored] = meds_penalty(rep.sizes[rep.scored], alpha, beta)
    visits = np.unique(samples.visit)
    num_prompts = int(samples.prompt.max()) + 1
    history: dict[str, Counter] = defaultdict(Counter)
    g3_per_visit: list[float | None] = []
    g1_groups, g1_wrong, g1_pen = [], [], []
    g4_groups, g4_sizes, g4_counts = [], [], []
    for v in visits:
        rows = np.flatnonzero(samples.visit == v)
        keys = [str(int(samples.prompt[i])) for i in rows]
        answers = [samples.answers[i] for i in rows]
        if v != visits[0]:
            groups = samples.prompt[rows].tolist()
            wrong = rep.scored[rows].tolist()
            g3_per_visit.append(top_answer_excess(groups, wrong, answers, pen[rows].tolist()))
            g1_groups += [int(v) * num_prompts + g for g in groups]
            g1_wrong += wrong
            g1_pen += pen[rows].tolist()
            counts = earlier_answer_counts(keys, answers, history)
            for j, i in enumerate(rows):
                if rep.scored[i]:
                    g4_groups.append(int(v) * num_prompts + int(samples.prompt[i]))
                    g4_sizes.append(float(rep.sizes[i]))
                    g4_counts.append(float(counts[j]))
        for k, a, i in zip(keys, answers, rows, strict=True):
            if a is not None and not samples.correct[i]:
                history[k][a] += 1
    return {
        "G1": distinct_penalty_share(g1_groups, g1_wrong, g1_pen) if g1_groups else None,
        "G3": _mean(g3_per_visit),
        "G4": size_recurrence_correlation(g4_groups, g4_sizes, g4_counts) if g4_groups else None,
        "G3_per_visit": g3_per_visit,
        "mean_size": float(rep.sizes[rep.scored & (samples.visit != visits[0])].mean())
        if (rep.scored & (samples.visit != visits[0])).any() else None,
    }


def cluster_figures(
    memories: dict[int, FeatureMemory | AnswerMemory], visits_per_checkpoint: int = 1
) -> dict[str, Any]:
    """After the last visit: clusters per prompt (mean over prompts with a stored row), the share
    of clusters whose rows all come from one visit, the mean number of visits a cluster spans
    (both pooled over every prompt's clusters), the same per checkpoint (two visits of one
    checkpoint share weights: training never has that; one checkpoint ~ one training step), and
    the share of stored responses in noise."""
    per_prompt, spans, ckpt_spans, noise = [], [], [], []
    for mem in memories.values():
        if not len(mem):
            continue
        clusters = mem.cluster_visits()
        per_prompt.append(len(clusters))
        spans += [len(set(c)) for c in clusters]
        ckpt_spans += [len({v // visits_per_checkpoint for v in c}) for c in clusters]
        noise.append(mem.noise_share())
    return {
        "clusters_per_prompt": _mean(per_prompt),
        "single_visit_share": float(np.mean([s == 1 for s in spans])) if spans else None,
        "visits_per_cluster": _mean(spans),
        "single_checkpoint_share": float(np.mean([s == 1 for s in ckpt_spans])) if ckpt_spans else None,
        "checkpoints_per_cluster": _mean(ckpt_spans),
        "noise_share": _mean(noise),
        "num_clusters": int(len(spans)),
    }


def _row_keys(x: np.ndarray) -> list[bytes]:
    return [np.ascontiguousarray(r).tobytes() for r in x]


def twin_share(keys: Sequence[Any], visit: np.ndarray, prompt: np.ndarray) -> float | None:
    """Share of rows with an identical twin (same ``keys``: bit-identical features, or the same
    text) in the same visit of the same prompt."""
    if not len(keys):
        return None
    count = Counter(zip(visit.tolist(), prompt.tolist(), keys, strict=True))
    return float(np.mean([count[(v, p, k)] >= 2
                          for v, p, k in zip(visit.tolist(), prompt.tolist(), keys, strict=True)]))


def recurring_share(keys: Sequence[Any], visit: np.ndarray, prompt: np.ndarray) -> float | None:
    """Share of a prompt's distinct ``keys`` (pooled over prompts) that come back at a later visit
    than their first."""
    seen: dict[tuple[int, Any], set[int]] = defaultdict(set)
    for v, p, k in zip(visit.tolist(), prompt.tolist(), keys, strict=True):
        seen[(p, k)].add(v)
    if not seen:
        return None
    return float(np.mean([len(vs) >= 2 for vs in seen.values()]))


def feature_figures(samples: Samples, feature: str, mixed_groups_only: bool = False) -> dict[str, Any]:
    """Twin and recurrence shares of the rows a store of ``feature`` remembers: of the bit-
    identical feature vectors, and of the response texts (for the answer store: texts only).
    ``recurring``: seen again at a later checkpoint (other weights, as at a later training step);
    ``recurring_same_weights``: at a later visit of the same checkpoint."""
    rows = np.flatnonzero(samples.usable(feature, mixed_groups_only))
    v, c, p = samples.visit[rows], samples.checkpoint[rows], samples.prompt[rows]
    texts = [samples.texts[i] for i in rows]
    out: dict[str, Any] = {"stored_rows": int(len(rows))}
    named = {"text_": texts}
    if feature != ANSWER_FEATURE:
        named[""] = _row_keys(samples.features[feature][rows])
    for prefix, keys in named.items():
        out[f"{prefix}twin_share"] = twin_share(keys, v, p)
        out[f"{prefix}recurring_share"] = recurring_share(keys, c, p)
        out[f"{prefix}recurring_same_weights_share"] = recurring_share(list(zip(c.tolist(), keys, strict=True)), v, p)
    return out


def route_agreement(samples: Samples, rep: Replay, routes: list[str] | None) -> dict[str, Any] | None:
    """``routes.cluster_route_agreement(groups, labels, routes)`` over the stored rows, each with
    its store's label after the last visit (noise -1); ``None`` without ``routes``."""
    if routes is None:
        return None
    labels = {i: label for mem in rep.memories.values() for i, label in mem.row_labels().items()}
    ids = sorted(labels)
    if not ids:
        return None
    out = cluster_route_agreement([int(samples.prompt[i]) for i in ids], [labels[i] for i in ids],
                                  [routes[i] for i in ids])
    return {k: (float(val) if isinstance(val, (int, float, np.floating)) else val) for k, val in dict(out).items()}


def response_routes(samples: Samples) -> list[str]:
    """Each response's route (``routes.route_of(problem, response)``)."""
    return [route_of(samples.problems[int(p)], t) for p, t in zip(samples.prompt, samples.texts, strict=True)]


def variant_figures(samples: Samples, feature: str, store: StoreSpec, s: AuditSettings,
                    routes: list[str] | None = None) -> dict[str, Any]:
    """Every figure of one (feature, store) variant."""
    rep = replay(samples, feature, store, s)
    figures = {"feature": feature, "store": store.name,
               **gate_figures(samples, rep, s.alpha, s.beta),
               **cluster_figures(rep.memories, samples.visits_per_checkpoint),
               **feature_figures(samples, feature, s.mixed_groups_only)}
    agreement = route_agreement(samples, rep, routes)
    if agreement is not None:
        figures["routes"] = agreement
    return figures


def all_variants(features: Sequence[str]) -> list[tuple[str, StoreSpec]]:
    """Every feature variant with every feature store, then the answer store once."""
    out = [(f, st) for f in features for st in STORES if st.kind == "features"]
    return out + [(ANSWER_FEATURE, st) for st in STORES if st.kind == "answer"]


# ---------------------------------------------------------------------------------------------
# the audit's own feature readers (the plug-in's reader gives the FeatureSpec variants)


def two_token_targets(answer_index: Sequence[int | None], response_ids: Sequence[Sequence[int]], prompt_length: int):
    """Capture targets for the reference feature of the first two answer tokens: for each
    response whose answer has a token after the first, positions ``t`` and ``t + 1`` (scoring
    ``ids[t + 1]`` and ``ids[t + 2]``). Returns ``(targets, responses read)``; each response's
    two rows are adjacent, first token first."""
    import torch

    from medsrl.features.logit_capture import CaptureTargets

    rows, positions, next_ids, kept = [], [], [], []
    width = prompt_length + max((len(r) for r in response_ids), default=0)
    for i, (t, resp) in enumerate(zip(answer_index, response_ids, strict=True)):
        if t is None or not 0 <= int(t) < len(resp) - 2:
            continue
        kept.append(i)
        for j in (0, 1):
            rows.append(i)
            positions.append(prompt_length + int(t) + j)
            next_ids.append(int(resp[int(t) + 1 + j]))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return CaptureTargets(as_long(rows), as_long(positions), as_long(next_ids), as_long(rows), width), kept


class AuditFeatureReader:
    """Every FEATURE variant of a batch from one forward: the plug-in's ``AnswerFeatureReader``
    per ``FeatureSpec`` (the ``digits`` one included) and the plug-in's ``LayerLogitCapture`` at
    two answer tokens."""

    def __init__(self, model, tokenizer, variants: Sequence[str]):
        from medsrl.features.logit_capture import LayerLogitCapture
        from medsrl.features.reader import AnswerFeatureReader

        unknown = [v for v in variants if v not in FEATURES]
        if unknown:
            raise ValueError(f"unknown feature variants {unknown}; known: {list(FEATURES)}")
        self.model, self.tokenizer, self.variants = model, tokenizer, list(variants)
        self.readers = {v: AnswerFeatureReader(model, tokenizer, FEATURES[v]) for v in self.variants
                        if FEATURES[v] is not None}
        ref = FeatureSpec()
        self.two = LayerLogitCapture(model, ref.layers, final_norm=ref.final_norm) if "two_tokens" in variants else None

    def read(self, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict[str, np.ndarray]:
        """``{variant: [B, D] float32}`` of one micro-batch; NaN rows: no feature."""
        import torch

        from medsrl.features.answer_locator import locate_answers
        from medsrl.rollout.base import pack_rollouts

        packed = pack_rollouts(prompt_ids, response_ids, pad_id)
        b = len(response_ids)
        rows = torch.arange(b)
        index = locate_answers(response_ids, self.tokenizer)
        for reader in self.readers.values():
            reader.begin(response_ids, packed.prompt_length)
        two_targets, two_rows = two_token_targets(index, response_ids, packed.prompt_length)
        with contextlib.ExitStack() as stack, torch.no_grad():
            for reader in self.readers.values():
                stack.enter_context(reader.microbatch(rows))
            if self.two is not None:
                self.two.clear()
                if len(two_targets):
                    stack.enter_context(self.two.capture(two_targets))
            self.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids, use_cache=False)
        result: dict[str, np.ndarray] = {}
        for name, reader in self.readers.items():
            feats, got = reader.finish()
            x = np.full((b, feats.shape[1] if feats.ndim == 2 else reader.num_features), np.nan, dtype=np.float32)
            x[got.numpy()] = feats.numpy()
            result[name] = x
        if self.two is not None:
            f = self.two.pop_features().numpy()  # [2 * kept, L], two rows per response
            x = np.full((b, 2 * len(self.two.layers)), np.nan, dtype=np.float32)
            if two_rows:
                x[two_rows] = f.reshape(len(two_rows), -1)
            result["two_tokens"] = x
        return {v: result[v] for v in self.variants}


# ---------------------------------------------------------------------------------------------
# the run: checkpoints, prompts, sampling


def run_config(run: Path) -> dict:
    """The run's Hydra config, or ``{}`` when it has none: each top-level section resolved on its
    own (``study.*`` interpolations in ``data``), left unresolved where it cannot be outside Hydra
    (``paths``: ``${hydra:...}``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    cfg = OmegaConf.load(path)
    out = {}
    for key in cfg:
        try:
            out[key] = OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
        except (OmegaConfBaseException, ValueError):
            out[key] = OmegaConf.to_container(cfg[key], resolve=False)
    return out


def checkpoint_step(path: Path) -> int:
    """A Lightning checkpoint's ``global_step`` (loaded on CPU)."""
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def find_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the run's checkpoints in step order; ``last.ckpt`` only when it holds a
    step no other file does."""
    found: dict[int, Path] = {}
    paths = sorted((run / "checkpoints").glob("*.ckpt"), key=lambda p: (p.name == "last.ckpt", p.name))
    for path in paths:
        step = checkpoint_step(path)
        found.setdefault(step, path)
    return sorted(found.items())


def find_warm_start(run: Path, cfg: dict) -> Path | None:
    """The warm start the run started from: ``model.name_or_path`` if set, else the cached warm
    start its ``model.warm_start`` names (``medsrl.warmstart``; never built here)."""
    model = cfg.get("model") or {}
    if model.get("name_or_path"):
        return Path(model["name_or_path"])
    if not model.get("warm_start"):
        return None
    from medsrl.warmstart import WarmStartConfig, warm_start_dir

    cache = ROOT / "data" / "cache"
    path = warm_start_dir(cache, dict(model.get("tiny") or {}), WarmStartConfig(**dict(model["warm_start"])))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{run}: its warm start {path} is not in the cache; pass --warm-start PATH or none")
    return path


def load_model(path: Path):
    """``(policy, tokenizer)`` from a warm-start directory or a run's ``.ckpt`` (``medsrl.eval``)."""
    from medsrl.eval import load_for_eval

    policy, tok = load_for_eval(str(path), None, "float32")
    return policy.eval(), tok


def training_pool(cfg: dict, pool: int | None) -> tuple[list, Callable[[str], bool]]:
    """The run's level-1 training pool (its first stage's first dataset), else
    ``generate_precedence(pool or 256, level=1, seed=0, split="train")``, and ``is_trap`` with
    the pool's ``wrong_routes`` when it sets them."""
    import functools

    from medsrl.data.precedence import generate_precedence, is_trap

    try:
        source = dict(cfg["data"]["stages"][0]["datasets"][0]["source"])
    except (KeyError, IndexError, TypeError):
        source = {}
    if not str(source.get("_target_", "")).endswith("generate_precedence"):
        source = {}
    num = pool if pool is not None else source.get("num")
    if not isinstance(num, int):  # an interpolation (${study.pool_l1}) or absent
        num = int((cfg.get("study") or {}).get("pool_l1", 256)) if pool is None else pool
    options = {k: v for k, v in source.items() if k not in ("_target_", "num")}
    options = {"level": 1, "seed": 0, "split": "train", **options}
    trap = functools.partial(is_trap, wrong_routes=options["wrong_routes"]) if "wrong_routes" in options else is_trap
    return generate_precedence(num, **options), trap


def choose_prompts(pool: Sequence, trap: Callable[[str], bool] | None = None, *, traps: int, others: int) -> list:
    """The first ``traps`` traps and first ``others`` non-traps of ``pool``, in pool order
    (``trap``: default ``precedence.is_trap``)."""
    if trap is None:
        from medsrl.data.precedence import is_trap as trap

    t = [ex for ex in pool if trap(ex.problem)][:traps]
    o = [ex for ex in pool if not trap(ex.problem)][:others]
    if len(t) < traps or len(o) < others:
        raise ValueError(f"the pool holds {len(t)} traps and {len(o)} others; asked for {traps} and {others}")
    chosen = {id(ex) for ex in t + o}
    return [ex for ex in pool if id(ex) in chosen]


def prompt_template(cfg: dict):
    from medsrl.data.template import PromptTemplate

    return PromptTemplate.from_config((cfg.get("data") or {}).get("template"))


def visit_seed(seed: int, step: int, visit: int) -> int:
    """The sampling seed of one visit (distinct per checkpoint step and visit, fixed by ``seed``)."""
    return seed * 1_000_003 + step * 10_007 + visit * 101


def visit_paths(out: Path, step: int, vi: int) -> tuple[Path, Path]:
    """The cache files of visit ``vi`` of the checkpoint at ``step``: arrays and records."""
    base = out / "samples" / f"step{step:06d}_visit{vi}"
    return base.with_suffix(".npz"), base.with_suffix(".jsonl")


def save_visit(out: Path, step: int, vi: int, arrays: dict, records: list[dict]) -> None:
    """The visit's records, then its arrays (whose presence marks the visit done), each atomic."""
    npz, jsonl = visit_paths(out, step, vi)
    atomic_write_text(jsonl, "".join(json.dumps(r) + "\n" for r in records))
    atomic_write(npz, lambda f: np.savez(f, **arrays), 0o644)


def sample_visit(
    policy, tok, prompts: list, texts: list[str], s: AuditSettings, seed: int, grader
) -> tuple[dict, list[dict]]:
    """One visit: ``n`` samples of every prompt, graded, with every feature variant."""
    from medsrl.rollout.base import SamplingParams
    from medsrl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(policy, tok, max_batch_size=s.max_batch_size)
    params = SamplingParams(n=s.n, temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=seed)
    batch = engine.generate(texts, params)
    golds = [prompts[i].answer for i in batch.prompt_index]
    grades = grader.grade_batch(batch.response_text, golds)
    reader = AuditFeatureReader(policy, tok, s.features)
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    step = max(1, s.feature_batch // s.n) * s.n  # whole prompts per forward
    for start in range(0, len(batch.response_ids), step):
        sl = slice(start, start + step)
        for k, x in reader.read(batch.prompt_ids[sl], batch.response_ids[sl], engine.pad_token_id).items():
            parts[k].append(x)
    arrays = {f"feat_{k}": np.concatenate(v) for k, v in parts.items()}
    arrays["prompt"] = np.asarray(batch.prompt_index, dtype=np.int64)
    arrays["correct"] = np.asarray([g.score > 0.5 for g in grades], dtype=bool)
    records = [{"prompt": int(p), "text": t, "answer": g.extracted, "correct": g.score > 0.5, "finish": f}
               for p, t, g, f in zip(batch.prompt_index, batch.response_text, grades, batch.finish_reason, strict=True)]
    return arrays, records


def open_cache(out: Path, s: AuditSettings, checkpoints: list[dict], prompts: list) -> None:
    """``<out>/samples/settings.json``: refused when the sampling settings, the prompts or the
    file of a cached step differ (visits would be mixed with other ones); a checkpoint the run
    saved since is added, so an audit can follow a run that is still training."""
    want = {"sampling": s.sampling_key(), "prompts": [ex.problem for ex in prompts],
            "checkpoints": {str(c["step"]): c["path"] for c in checkpoints}}
    path = out / "samples" / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        have = json.loads(path.read_text())
        diff = [k for k in ("sampling", "prompts") if json.dumps(have.get(k)) != json.dumps(want[k])]
        old = have.get("checkpoints", {})
        diff += [f"checkpoint of step {k}" for k, v in want["checkpoints"].items() if k in old and old[k] != v]
        if diff:
            raise SystemExit(f"[audit] {out}/samples holds samples made with other {', '.join(diff)}; "
                             "use another --out, or delete that folder")
        want["checkpoints"] = {**old, **want["checkpoints"]}
    atomic_write_text(path, json.dumps(want, indent=1))


def sample_all(s: AuditSettings, checkpoints: list[dict], prompts: list, template) -> float:
    """Sample and read every visit not cached yet; returns the seconds spent."""
    import torch

    from medsrl.reward.grader import MathGrader

    out = Path(s.out)
    open_cache(out, s, checkpoints, prompts)
    texts = [template.render(ex.problem) for ex in prompts]
    t0 = time.perf_counter()
    with MathGrader(num_workers=1) as grader:
        for ci, ck in enumerate(checkpoints):
            todo = [vi for vi in range(s.visits) if not visit_paths(out, ck["step"], vi)[0].is_file()]
            if not todo:
                print(f"[audit] checkpoint {ci + 1}/{len(checkpoints)} (step {ck['step']}): cached", flush=True)
                continue
            policy, tok = load_model(Path(ck["path"]))
            for vi in todo:
                t1 = time.perf_counter()
                with torch.no_grad():
                    arrays, records = sample_visit(policy, tok, prompts, texts, s,
                                                   visit_seed(s.seed, ck["step"], vi), grader)
                save_visit(out, ck["step"], vi, arrays, records)
                acc = float(arrays["correct"].mean())
                print(f"[audit] checkpoint {ci + 1}/{len(checkpoints)} (step {ck['step']}), visit {vi + 1}/{s.visits}: "
                      f"{len(records)} responses, accuracy {acc:.3f}, {time.perf_counter() - t1:.1f} s", flush=True)
            del policy
    return time.perf_counter() - t0


def load_samples(out: Path, steps: Sequence[int], visits: int, problems: list[str], features: Sequence[str]) -> Samples:
    """The cached visits of the checkpoints at ``steps``, in order, as one :class:`Samples`."""
    missing = [visit_paths(out, step, vi)[0].name for step in steps for vi in range(visits)
               if not visit_paths(out, step, vi)[0].is_file()]
    if missing:
        raise SystemExit(f"[audit] {out}/samples lacks {', '.join(missing)}: run without --report-only")
    vis, prm, cor, ans, txt = [], [], [], [], []
    feats: dict[str, list[np.ndarray]] = defaultdict(list)
    for ci, step in enumerate(steps):
        for vi in range(visits):
            npz, jsonl = visit_paths(out, step, vi)
            with np.load(npz) as z:
                records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
                vis.append(np.full(len(records), ci * visits + vi, dtype=np.int64))
                prm.append(z["prompt"])
                cor.append(z["correct"])
                for f in features:
                    feats[f].append(z[f"feat_{f}"])
            ans += [r["answer"] for r in records]
            txt += [r["text"] for r in records]
    return Samples(np.concatenate(vis), np.concatenate(prm), np.concatenate(cor), ans, txt,
                   {f: np.concatenate(v) for f, v in feats.items()}, problems, visits)


def sampling_summary(samples: Samples, prompts: list, trap: Sequence[bool]) -> list[dict]:
    """Per visit: accuracy, wrong responses, and on traps the shortcut's share of wrong answers."""
    from medsrl.data.precedence import shortcut_answer

    trap = np.asarray(trap, dtype=bool)
    short = [shortcut_answer(ex.problem) for ex in prompts]
    out = []
    for v in np.unique(samples.visit):
        rows = np.flatnonzero(samples.visit == v)
        wrong_trap = [i for i in rows if not samples.correct[i] and trap[samples.prompt[i]]]
        out.append({
            "visit": int(v), "accuracy": float(samples.correct[rows].mean()),
            "trap_accuracy": float(samples.correct[rows][trap[samples.prompt[rows]]].mean()) if trap.any() else None,
            "wrong": int((~samples.correct[rows]).sum()),
            "shortcut_share_of_trap_errors": float(np.mean([samples.answers[i] == short[samples.prompt[i]]
                                                            for i in wrong_trap]))
            if wrong_trap else None,
        })
    return out


# ---------------------------------------------------------------------------------------------
# the report

COLUMNS = (  # (key, header, caption)
    ("G1", "G1", "share of (visit, prompt) groups whose wrong responses carry >= 2 distinct penalties"),
    ("G3", "G3", "penalty share on each group's most frequent wrong answer minus its share of wrong responses "
                 "(mean over visits)"),
    ("G4", "G4", "within-group Spearman of cluster size vs earlier count of the same answer"),
    ("clusters_per_prompt", "clusters/prompt", "clusters per prompt's store after the last visit"),
    ("single_visit_share", "1-visit clusters", "share of clusters whose rows all come from one visit"),
    ("visits_per_cluster", "visits/cluster", "mean visits a cluster's rows span"),
    ("single_checkpoint_share", "1-ckpt clusters",
     "share of clusters whose rows all come from one checkpoint (one set of weights)"),
    ("twin_share", "twins", "share of stored wrong rows with a bit-identical same-visit twin"),
    ("recurring_share", "recurring", "share of a prompt's distinct feature vectors seen again at a later checkpoint"),
    ("recurring_same_weights_share", "recurring (same ckpt)", "... at a later visit of the same checkpoint"),
)


def _fmt(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def route_keys(variants: list[dict]) -> list[str]:
    """The numeric figures ``cluster_route_agreement`` returned (purity, ARI, ...), in order."""
    keys: dict[str, None] = {}
    for v in variants:
        for k, x in (v.get("routes") or {}).items():
            if isinstance(x, (int, float)) and not isinstance(x, bool) and k != "groups":
                keys.setdefault(k)  # groups: how many prompts were averaged (audit.json only)
    return list(keys)


def markdown_table(variants: list[dict], routes: bool) -> str:
    """One row per (feature, store) variant, a caption line first."""
    cols = list(COLUMNS)
    caption = "; ".join(f"**{h}**: {c}" for _, h, c in cols)
    headers = ["feature", "store"] + [h for _, h, _ in cols]
    extra = route_keys(variants) if routes else []
    if extra:
        headers += [f"route {k}" for k in extra]
        caption += "; **route ...**: the stored rows' clusters against their routes (studies.routes)"
    caption += ". Feature `-`: the answer-keyed memory (no features)."
    lines = [caption, "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for v in variants:
        cells = [v["feature"], v["store"]] + [_fmt(v.get(k)) for k, _, _ in cols]
        cells += [_fmt((v.get("routes") or {}).get(k)) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(s: AuditSettings, checkpoints: list[dict], prompts: list, trap: Sequence[bool], seconds: dict) -> dict:
    """Replay every variant on the cached samples; write ``audit.json`` and ``audit.md``."""
    out = Path(s.out)
    problems = [ex.problem for ex in prompts]
    t0 = time.perf_counter()
    samples = load_samples(out, [c["step"] for c in checkpoints], s.visits, problems, s.features)
    routes = response_routes(samples)
    variants = []
    pairs = all_variants(s.features)
    for j, (feature, store) in enumerate(pairs):
        variants.append(variant_figures(samples, feature, store, s, routes))
        print(f"[audit] replay {j + 1}/{len(pairs)}: feature {feature}, store {store.name}", flush=True)
    seconds = {**seconds, "replay": round(time.perf_counter() - t0, 1)}
    result = {
        "settings": asdict(s),
        "stores": [asdict(st) for st in STORES],
        "checkpoints": checkpoints,
        "prompts": [{"problem": ex.problem, "answer": ex.answer, "key": ex.key, "trap": bool(t)}
                    for ex, t in zip(prompts, trap, strict=True)],
        "visits": sampling_summary(samples, prompts, trap),
        "responses": len(samples),
        "variants": variants,
        "seconds": seconds,
    }
    atomic_write_text(out / "audit.json", json.dumps(result, indent=1, default=_json_default))
    head = (f"# MEDS memory audit (D1)\n\n{len(checkpoints)} checkpoints (steps "
            f"{', '.join(str(c['step']) for c in checkpoints)}) x {s.visits} visits x {len(prompts)} prompts "
            f"({s.traps} traps, {s.others} others) x {s.n} samples; run `{s.run}`.\n\n")
    atomic_write_text(out / "audit.md", head + markdown_table(variants, routes=True))
    return result


def _json_default(x: Any):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def checkpoint_list(s: AuditSettings, run: Path, cfg: dict) -> list[dict]:
    """The warm start (step 0, unless ``none``) and the run's checkpoints, in step order."""
    out = []
    if s.warm_start != "none":
        ws = find_warm_start(run, cfg) if s.warm_start == "auto" else Path(s.warm_start)
        if ws is not None:
            out.append({"step": 0, "path": str(ws), "kind": "warm_start"})
    out += [{"step": step, "path": str(p), "kind": "checkpoint"} for step, p in find_checkpoints(run) if step > 0]
    if s.max_checkpoints is not None:
        out = out[: s.max_checkpoints]
    if not out:
        raise SystemExit(f"[audit] {run}: no warm start and no checkpoint to audit")
    return out


def run_audit(s: AuditSettings, *, report_only: bool = False) -> dict:
    run = Path(s.run)
    s.out = s.out or str(run / "audit")
    cfg = run_config(run)
    gen = cfg.get("rollout") or {}
    if s.temperature is None:
        s.temperature = float(gen.get("temperature", 1.0))
    if s.max_new_tokens is None:
        s.max_new_tokens = int(gen.get("max_new_tokens", 80))
    checkpoints = checkpoint_list(s, run, cfg)
    pool, is_trap = training_pool(cfg, s.pool)
    prompts = choose_prompts(pool, is_trap, traps=s.traps, others=s.others)
    trap = [is_trap(ex.problem) for ex in prompts]
    print(f"[audit] {len(checkpoints)} checkpoints (steps {[c['step'] for c in checkpoints]}), {len(prompts)} prompts, "
          f"{s.visits} visits x {s.n} samples -> {s.out}", flush=True)
    seconds = {}
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        if not report_only:
            seconds["sampling"] = round(sample_all(s, checkpoints, prompts, prompt_template(cfg)), 1)
        result = report(s, checkpoints, prompts, trap, seconds)
    finally:
        torch.set_num_threads(threads)
    print(f"[audit] wrote {s.out}/audit.json and audit.md", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    d = AuditSettings()
    p = argparse.ArgumentParser(prog="python -m studies.audit", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a training run directory (with checkpoints/ and .hydra/config.yaml)")
    p.add_argument("--out", default="", help="default <run>/audit")
    p.add_argument("--warm-start", default=d.warm_start, help="auto (from the run's config), none, or a path")
    p.add_argument("--visits", type=int, default=d.visits, help="visits per checkpoint")
    p.add_argument("--n", type=int, default=d.n, help="samples per prompt and visit")
    p.add_argument("--traps", type=int, default=d.traps)
    p.add_argument("--others", type=int, default=d.others)
    p.add_argument("--pool", type=int, default=None, help="level-1 training pool size (default: the run's)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-checkpoints", type=int, default=None)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    p.add_argument("--features", nargs="+", default=d.features, choices=list(FEATURES))
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--mixed-groups-only", action="store_true", help="only groups with right and wrong responses")
    p.add_argument("--report-only", action="store_true", help="no sampling: report the cached samples")
    a = vars(p.parse_args(argv))
    report_only = a.pop("report_only")
    t0 = time.perf_counter()
    run_audit(AuditSettings(**a), report_only=report_only)
    print(f"[audit] done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
