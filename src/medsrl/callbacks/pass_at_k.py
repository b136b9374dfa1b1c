"""Held-out validation during training: accuracy, pass@k and diversity as medsrl-eval measures them,
with the same sampling seed each time, so successive points differ by the policy, not the dice.

Each rank samples a contiguous share of the problems, each seeded by its global index; the records
are gathered in problem order. A rank with no problems still joins every collective. Memory: all
is sampled, then the engine released, then the features read in one pass under the run's autocast.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated, Literal

from lightning.pytorch.callbacks import Callback
from typing_extensions import Doc

from medsrl.callbacks.progress import set_progress_status
from medsrl.evaluation.response_features import response_features
from medsrl.evaluation.responses import (
    BatchSize,
    SampledChunk,
    Samples,
    SamplingSpec,
    Temperature,
    TopP,
    chunk_records,
    joined_rollout,
    sample_chunk,
    share_chunks,
    summarize_records,
)
from medsrl.features.reader import FeatureSpec
from medsrl.settings import Count, Flag, PositiveInt, Seed, nullable
from medsrl.utils.distributed import all_gather_objects, rank_and_size

_NOT_LOGGED = ("run", "benchmark", "problems", "n", "mean@n")  # mean@n == pass@1


class PassAtKValidation(Callback):
    """Logs ``val/accuracy`` (= pass@1), ``val/pass@k``, ``val/maj@n`` and diversity, per data set
    too, before the first step (``at_start``), every ``every_n_steps`` (0: off) and after the last."""

    def __init__(
        self,
        every_n_steps: Annotated[Count, Doc("validate every N steps, also before the first (at_start) and after "
                                            "the last; 0: off")] = 20,
        n: Samples = 8,
        num_problems: Annotated[nullable(PositiveInt), Doc("the first N held-out prompts; null: all")] = None,
        at_start: Annotated[Flag, Doc("validate before the first step too")] = True,
        temperature: Temperature = 1.0,
        top_p: TopP = 1.0,
        max_new_tokens: Annotated[nullable(PositiveInt), Doc("null: rollout.max_new_tokens")] = None,
        features: Annotated[Literal["run"] | dict | None, Doc(
            "the diversity feature: run (the feature plug-in's, MEDS or novelty, when the run has one), "
            "a FeatureSpec mapping, or null: none")] = "run",
        batch_size: BatchSize = 128,
        seed: Annotated[Seed, Doc("the sampling seed (the same draws at every validation)")] = 1234,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.num_problems = num_problems
        self.at_start = at_start
        self._sampling = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              features=features, batch_size=batch_size, seed=seed)
        self.sampling: SamplingSpec | None = None
        self.last_rows: list[dict] = []
        self.history: list[tuple[int, float]] = []  # (step, val/accuracy) for the run summary

    def setup(self, trainer, pl_module, stage: str) -> None:
        """The sampling, with ``max_new_tokens`` and ``features="run"`` resolved from the run."""
        values = dict(self._sampling)
        if values["features"] == "run":
            specs = [p.features for p in getattr(pl_module, "plugins", [])
                     if isinstance(getattr(p, "features", None), FeatureSpec)]
            values["features"] = specs[0] if specs else FeatureSpec()
        elif isinstance(values["features"], dict):
            values["features"] = FeatureSpec.model_validate(values["features"])
        values["max_new_tokens"] = values["max_new_tokens"] or pl_module.rollout_cfg.max_new_tokens
        self.sampling = SamplingSpec.model_construct(**values)  # checked at start, as this class's settings

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step == 0 and self.at_start:
            self._evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps > 0 and trainer.global_step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        last = self.history[-1][0] if self.history else None
        if trainer.global_step > 0 and last != trainer.global_step:  # the end figure
            self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer, pl_module) -> None:
        problems = trainer.datamodule.val_prompts()[: self.num_problems]
        if not problems or self.every_n_steps <= 0:
            return
        set_progress_status(trainer, "validating")  # the step bar, instead of looking stuck
        settings = self.sampling
        with trainer.precision_plugin.forward_context():
            mine = _sample_share(pl_module, problems, settings)
        records = _gathered_records(mine)
        by_source = defaultdict(list)
        for p, rec in zip(problems, records, strict=True):
            by_source[p.source].append(rec)
        rows = [summarize_records("", "all", records)]
        if len(by_source) > 1:
            rows += [summarize_records("", source, recs) for source, recs in by_source.items()]
        self.last_rows = rows
        accuracy = float(rows[0]["pass@1"])
        self.history.append((trainer.global_step, accuracy))
        metrics = {"val/accuracy": accuracy, "val/num_samples": float(len(records) * settings.n)}
        for row in rows:
            prefix = "val/" if row["benchmark"] == "all" else f"val/{row['benchmark']}/"
            for name, value in row.items():
                if name not in _NOT_LOGGED and value == value:  # skip NaN (no features)
                    metrics[prefix + name] = float(value)
        # Straight to the loggers: this also runs from on_train_start, where self.log cannot.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        set_progress_status(trainer, "")


def _sample_share(pl_module, problems, settings: SamplingSpec) -> list[dict]:
    """This rank's records (every rank runs each step, with no problems too: collectives)."""
    engine = pl_module.engine
    pl_module.sync_engine(stale_only=True)
    with pl_module.policy_for_generation():  # HF under FSDP: the policy gathered for sampling
        sampled = [sample_chunk(engine, pl_module.grader, problems, idx, settings)
                   for idx in share_chunks(len(problems), settings, *rank_and_size())]
    engine.release()  # every rank: its engine's memory goes to the feature pass and the update
    return _with_features(pl_module, sampled, settings)


def _with_features(pl_module, sampled: list[SampledChunk], settings: SamplingSpec) -> list[dict]:
    """The sampled parts' records with their features, read in one pass over all of them."""
    feats = [None] * sum(len(c.rollout) for c in sampled)
    if settings.features is not None:
        algo = pl_module.algorithm  # the update's budget: the memory it is planned for
        feats = response_features(pl_module.policy, pl_module.tokenizer, joined_rollout(sampled),
                                  spec=settings.features, micro_batch_size=algo.micro_batch_size,
                                  max_tokens=algo.max_tokens_per_microbatch,
                                  reasoning_end=pl_module.grader.reasoning_end)
    records, at = [], 0
    for chunk in sampled:
        records += chunk_records(chunk, feats[at:at + len(chunk.rollout)])
        at += len(chunk.rollout)
    return records


def _gathered_records(mine: list[dict]) -> list[dict]:
    """Every rank's records in problem order: the summary one process would make."""
    return sorted((rec for part in all_gather_objects(mine) for rec in part), key=lambda rec: rec["index"])
