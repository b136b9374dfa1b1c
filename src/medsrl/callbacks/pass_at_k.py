"""pass@k and diversity on held-out prompts during training, the same evaluation as medsrl-eval.

Every ``every_n_steps`` RL steps (and before the first one) the policy samples ``n`` responses
for the first ``num_problems`` held-out prompts of the DataModule; the callback logs
``val/pass@k`` for k = 1, 2, 4 .. n, ``val/maj@n`` and the diversity figures (distinct answers,
distinct wrong answers, top-1 eigen ratio of the MEDS features, error clusters). The sampling
seed is the same at every evaluation, so successive points differ by the policy, not the dice.
"""

from __future__ import annotations

from collections import defaultdict

from lightning.pytorch.callbacks import Callback

from medsrl.evaluation.runner import EvalProblem, EvalSettings, sample_problems, summarize_records

_NOT_LOGGED = ("run", "benchmark", "problems", "n", "mean@n")  # mean@n == pass@1


class PassAtKValidation(Callback):
    """Logs ``val/pass@k`` and diversity every N steps (per data set too, when there are several)."""

    def __init__(
        self,
        every_n_steps: int = 20,
        n: int = 8,
        num_problems: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int | None = None,
        feature_layers=14,
        batch_size: int = 128,
        seed: int = 1234,
    ) -> None:
        self.every_n_steps = every_n_steps
        self.num_problems = num_problems
        self.max_new_tokens = max_new_tokens
        self.settings = EvalSettings(
            n=n,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            batch_size=batch_size,
            feature_layers=feature_layers,
        )
        self.last_rows: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step == 0:
            self._evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps > 0 and step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer, pl_module) -> None:
        prompts = trainer.datamodule.val_prompts()[: self.num_problems]
        if not prompts or self.every_n_steps <= 0:
            return
        max_new = self.max_new_tokens or pl_module.rollout_cfg.max_new_tokens
        settings = EvalSettings(**{**self.settings.__dict__, "max_new_tokens": max_new})
        problems = [EvalProblem(p.key, p.text, p.problem, p.answer) for p in prompts]
        with pl_module.full_policy() as policy:  # FSDP: the whole weights for sampling
            records = sample_problems(
                policy, pl_module.tokenizer, pl_module.engine, pl_module.grader, problems, settings
            )
        by_source = defaultdict(list)
        for p, rec in zip(prompts, records, strict=True):
            by_source[p.source].append(rec)
        rows = [summarize_records("", "all", records)]
        if len(by_source) > 1:
            rows += [summarize_records("", source, recs) for source, recs in by_source.items()]
        self.last_rows = rows
        metrics = {}
        for row in rows:
            prefix = "val/" if row["benchmark"] == "all" else f"val/{row['benchmark']}/"
            for name, value in row.items():
                if name not in _NOT_LOGGED and value == value:  # skip NaN (no features)
                    metrics[prefix + name] = float(value)
        # Straight to the loggers: this also runs from on_train_start, where self.log cannot.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
