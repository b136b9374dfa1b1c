"""Sample, grade and featurise ``n`` responses per problem, chunk by chunk, resumably.

Problems are taken in fixed chunks of ``max(1, batch_size // n)``, the one starting at problem
``s`` sampled with seed ``seed + s``: a resumed run re-samples only the chunks it had not finished
and ends with the same records, hence the same table, as a run in one go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from medsrl.data.example import Prompt
from medsrl.data.template import PromptTemplate
from medsrl.evaluation.response_features import response_features
from medsrl.evaluation.store import GenerationStore, settings_fingerprint
from medsrl.evaluation.tables import summarize_benchmark
from medsrl.methods.meds.features import FeatureSpec
from medsrl.rollout.base import SamplingParams


@dataclass(frozen=True)
class EvalSettings:
    """What decides the generations (all of it goes into the resume fingerprint)."""

    n: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    batch_size: int = 64
    features: FeatureSpec | None = FeatureSpec()  # MEDS features (diversity); None: no features
    extra: dict[str, Any] = field(default_factory=dict)  # template etc.: fingerprinted only

    @property
    def chunk_size(self) -> int:
        return max(1, self.batch_size // self.n)

    def fingerprint(self, run_source: str, benchmark: str) -> str:
        return settings_fingerprint({**asdict(self), "model": run_source, "benchmark": benchmark})


def problems_from(examples, template: dict[str, Any], tokenizer=None) -> list[Prompt]:
    """The ``MathExample`` s as prompts rendered in the prompt format ``template``
    (``data.template`` settings; ``kind=chat`` renders with ``tokenizer``)."""
    fmt = PromptTemplate.from_config(template)
    return [Prompt(e.key, fmt.render(e.problem, tokenizer), e.problem, e.answer, e.source) for e in examples]


def sample_problems(
    policy, tokenizer, engine, grader, problems: Sequence[Prompt], settings: EvalSettings, *,
    run: str = "", benchmark: str = "", store: GenerationStore | None = None,
    fingerprint: str | None = None,
) -> list[dict[str, Any]]:
    """One record per problem (its n responses, grades and features), in problem order; with a
    ``store``, records already there are reused and new ones written as each chunk finishes."""
    records: list[dict[str, Any]] = []
    chunk = settings.chunk_size
    for start in range(0, len(problems), chunk):
        idx = range(start, min(start + chunk, len(problems)))
        if store is not None and all(store.lookup(run, benchmark, i, fingerprint) for i in idx):
            records += [store.lookup(run, benchmark, i, fingerprint) for i in idx]
            continue
        batch = [problems[i] for i in idx]
        params = SamplingParams(
            n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
            max_new_tokens=settings.max_new_tokens, seed=settings.seed + start,
        )
        rollout = engine.generate([p.text for p in batch], params)
        grades = grader.grade_batch(rollout.response_text, [batch[j].answer for j in rollout.prompt_index])
        feats = [None] * len(rollout)
        if settings.features is not None:
            feats = response_features(policy, tokenizer, rollout, spec=settings.features,
                                      reasoning_end=grader.reasoning_end)
        per_problem: list[list[dict[str, Any]]] = [[] for _ in batch]
        for r, g in enumerate(grades):
            per_problem[rollout.prompt_index[r]].append({
                "text": rollout.response_text[r],
                "extracted": g.extracted,
                "score": g.score,
                "finish_reason": rollout.finish_reason[r],
                "timed_out": g.timed_out,
                "feature": feats[r],
            })
        for j, (i, p) in enumerate(zip(idx, batch, strict=True)):
            rec = {
                "run": run,
                "benchmark": benchmark,
                "index": i,
                "key": p.key,
                "problem": p.problem,
                "gold": p.answer,
                "responses": per_problem[j],
            }
            if store is not None:
                store.add(rec, fingerprint)
            records.append(rec)
    return records


def summarize_records(
    run: str, benchmark: str, records: Sequence[dict[str, Any]]
) -> dict[str, Any]:
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
