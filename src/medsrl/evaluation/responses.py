"""Sample, grade and featurise ``n`` responses per problem, resumably: fixed chunks of
``max(1, batch_size // n)`` problems, the one at problem ``s`` seeded ``seed + s``, so a resumed run,
or one over several ranks (:func:`share_chunks`), ends with the same records as one run in one go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from typing_extensions import Doc

from medsrl.data.example import Prompt
from medsrl.data.template import PromptTemplate
from medsrl.evaluation.progress import BenchmarkBar
from medsrl.evaluation.response_features import response_features
from medsrl.evaluation.store import GenerationStore, settings_fingerprint
from medsrl.evaluation.tables import summarize_benchmark
from medsrl.features.reader import FeatureSpec
from medsrl.rollout.base import RolloutBatch, SamplingParams
from medsrl.settings import Fraction, NonNegative, PositiveInt, Seed, Settings
from medsrl.utils.distributed import shard_bounds

# The sampling settings with their help: SamplingSpec's fields, and validation's (flat) parameters
Samples = Annotated[PositiveInt, Doc("samples per problem (pass@k for k up to n)")]
Temperature = Annotated[NonNegative, Doc("sampling temperature; 0: greedy")]
TopP = Annotated[Fraction, Doc("nucleus sampling")]
BatchSize = Annotated[PositiveInt, Doc("sequences per generation call (chunks of batch_size // n problems)")]


class SamplingSpec(Settings):
    """How a policy is sampled to be measured (eval, RL validation, the warm start); all fingerprinted."""

    n: Samples = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    max_new_tokens: Annotated[PositiveInt, Doc("tokens a response may have")] = 128
    seed: Annotated[Seed, Doc("the sampling seed: the chunk at problem s is sampled with seed + s")] = 0
    batch_size: BatchSize = 64
    features: Annotated[FeatureSpec | None, Doc(
        "the MEDS feature of each response (diversity); null: none")] = FeatureSpec()

    def fingerprint(self, model: str, benchmark: str, **extra: Any) -> str:
        """The resume fingerprint (``extra``: the rest that decides the generations: template, ...)."""
        values = {k: getattr(self, k) for k in SamplingSpec.model_fields}
        values["features"] = None if self.features is None else self.features.model_dump()
        return settings_fingerprint({**values, "extra": extra, "model": model, "benchmark": benchmark})


def problems_from(examples, template: PromptTemplate | dict[str, Any], tokenizer=None) -> list[Prompt]:
    """The ``MathExample`` s rendered as prompts (``kind=chat`` renders with ``tokenizer``)."""
    fmt = PromptTemplate.from_config(template)
    return [Prompt(e.key, fmt.render(e.problem, tokenizer), e.problem, e.answer, e.source) for e in examples]


@dataclass
class SampledChunk:
    """One sampling chunk: its problems' indices, the problems, their responses and grades."""

    indices: range
    problems: list[Prompt]
    rollout: RolloutBatch
    grades: list


def sample_chunk(engine, grader, problems: Sequence[Prompt], indices: range, settings: SamplingSpec) -> SampledChunk:
    """Sample and grade the chunk of ``problems`` at ``indices``, seeded by its first problem."""
    batch = [problems[i] for i in indices]
    params = SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                            max_new_tokens=settings.max_new_tokens, seed=settings.seed + indices.start)
    rollout = engine.generate([p.text for p in batch], params)
    grades = grader.grade_batch(rollout.response_text, [batch[j].answer for j in rollout.prompt_index])
    return SampledChunk(indices, batch, rollout, grades)


def chunks_of(num_problems: int, settings: SamplingSpec) -> list[range]:
    """The fixed sampling chunks of ``num_problems`` problems."""
    size = max(1, settings.batch_size // settings.n)
    return [range(s, min(s + size, num_problems)) for s in range(0, num_problems, size)]


def share_chunks(num_problems: int, settings: SamplingSpec, rank: int, size: int) -> list[range]:
    """Rank ``rank``'s contiguous share of the problems (``shard_bounds``) cut into the fixed chunks: a
    chunk no share boundary cuts is sampled as one process does."""
    start, stop = shard_bounds(num_problems, rank, size)
    parts = (range(max(c.start, start), min(c.stop, stop)) for c in chunks_of(num_problems, settings))
    return [part for part in parts if len(part)]


def chunk_records(chunk: SampledChunk, features: Sequence[list[float] | None], *, run: str = "",
                  benchmark: str = "") -> list[dict[str, Any]]:
    """One record per problem of ``chunk`` (its n responses, grades and ``features``)."""
    rollout = chunk.rollout
    per_problem: list[list[dict[str, Any]]] = [[] for _ in chunk.problems]
    for r, g in enumerate(chunk.grades):
        per_problem[rollout.prompt_index[r]].append({
            "text": rollout.response_text[r], "extracted": g.extracted, "score": g.score,
            "finish_reason": rollout.finish_reason[r], "timed_out": g.timed_out, "feature": features[r],
        })
    return [
        {"run": run, "benchmark": benchmark, "index": i, "key": p.key, "problem": p.problem,
         "gold": p.answer, "responses": per_problem[j]}
        for j, (i, p) in enumerate(zip(chunk.indices, chunk.problems, strict=True))
    ]


def joined_rollout(chunks: Sequence[SampledChunk]) -> RolloutBatch:
    """The chunks' responses as one batch, for one feature pass over them all."""
    out, offset = RolloutBatch.empty(), 0
    for c in chunks:
        out.prompt_index += [offset + i for i in c.rollout.prompt_index]
        offset += len(c.problems)
        for k in ("prompt_ids", "response_ids", "response_text", "finish_reason"):
            getattr(out, k).extend(getattr(c.rollout, k))
    return out


def sample_problems(
    policy, tokenizer, engine, grader, problems: Sequence[Prompt], settings: SamplingSpec, *,
    run: str = "", benchmark: str = "", store: GenerationStore | None = None,
    fingerprint: str | None = None, bar: BenchmarkBar | None = None,
) -> list[dict[str, Any]]:
    """One record per problem, in order; with a ``store``, stored records are reused, new ones written."""
    records: list[dict[str, Any]] = []
    for idx in chunks_of(len(problems), settings):
        if store is not None and all(store.lookup(run, benchmark, i, fingerprint) for i in idx):
            records += [store.lookup(run, benchmark, i, fingerprint) for i in idx]
            if bar is not None:
                bar.stored(len(idx))
            continue
        chunk = sample_chunk(engine, grader, problems, idx, settings)
        feats = [None] * len(chunk.rollout)
        if settings.features is not None:
            feats = response_features(policy, tokenizer, chunk.rollout, spec=settings.features,
                                      reasoning_end=grader.reasoning_end)
        for rec in chunk_records(chunk, feats, run=run, benchmark=benchmark):
            if store is not None:
                store.add(rec, fingerprint)
            records.append(rec)
        if bar is not None:
            bar.sampled(len(idx))
    return records


def summarize_records(run: str, benchmark: str, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The table row (pass@k, mean@n, maj@n, diversity) of one run on one benchmark."""
    answers = [[r["extracted"] for r in rec["responses"]] for rec in records]
    scores = [[float(r["score"]) for r in rec["responses"]] for rec in records]
    features = [_feature_matrix(rec["responses"]) for rec in records]
    return summarize_benchmark(run, benchmark, answers, scores, features)


def _feature_matrix(responses: Sequence[dict[str, Any]]) -> np.ndarray | None:
    """[n, D] features of a problem's responses, NaN rows where a response has none."""
    dims = {len(r["feature"]) for r in responses if r.get("feature") is not None}
    if not dims:
        return None
    (d,) = dims
    out = np.full((len(responses), d), np.nan)
    for i, r in enumerate(responses):
        if r.get("feature") is not None:
            out[i] = r["feature"]
    return out
