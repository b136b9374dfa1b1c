"""A few prompts and responses per N steps, as TensorBoard text, a W&B table and a jsonl file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import Doc

from medsrl.settings import Count, PositiveInt
from medsrl.utils.run_dir import run_log_dir
from medsrl.utils.wandb_log import wandb_loggers

# The columns of the W&B table ``samples`` (the keys of a samples.jsonl record).
TABLE_COLUMNS = ("step", "key", "problem", "gold", "response", "extracted", "reward", "score")


class SampleLogger(Callback):
    """What the policy writes, from the rollouts the step trained on (raw reward and shaped score)."""

    def __init__(self, every_n_steps: Annotated[Count, Doc("log samples every N steps (TensorBoard text, "
                                                          "samples.jsonl); 0: off")] = 10,
                 num_samples: Annotated[Count, Doc("responses logged each time")] = 4,
                 max_chars: Annotated[PositiveInt, Doc("each cut to this many characters")] = 2000) -> None:
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.max_chars = max_chars
        self._tables: dict[int, object] = {}  # id(WandbLogger) -> its incremental wandb.Table

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollouts = pl_module.last_rollouts
        if rollouts is None or rollouts.step != batch.get("step", trainer.global_step - 1):
            return  # a skipped step trained on nothing
        if self.every_n_steps <= 0 or rollouts.step % self.every_n_steps:
            return
        records = []
        for i in range(min(self.num_samples, len(rollouts))):
            prompt = rollouts.prompts[int(rollouts.group_ids[i])]
            records.append({
                "step": rollouts.step, "key": prompt.key, "problem": prompt.problem, "gold": prompt.answer,
                "response": rollouts.response_text[i][: self.max_chars],
                "extracted": rollouts.grades[i].extracted,
                "reward": float(rollouts.reward[i]), "score": float(rollouts.scores[i]),
            })
        text = "\n\n---\n\n".join(_markdown(r) for r in records)
        for lg in trainer.loggers:
            if isinstance(lg, TensorBoardLogger):
                lg.experiment.add_text("samples", text, global_step=rollouts.step)
        if trainer.is_global_zero:
            path = Path(run_log_dir(trainer)) / "samples.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            self._log_table(wandb_loggers(trainer.loggers), records, rollouts.step)

    def _log_table(self, loggers: list, records: list[dict], step: int) -> None:
        """An ``INCREMENTAL`` table per W&B logger: each log sends only the new rows."""
        if not loggers or not records:
            return
        import wandb

        for lg in loggers:
            table = self._tables.get(id(lg))
            if table is None:
                table = wandb.Table(columns=list(TABLE_COLUMNS), log_mode="INCREMENTAL")
                self._tables[id(lg)] = table
            for r in records:
                table.add_data(*(r[c] for c in TABLE_COLUMNS))
            lg.log_metrics({"samples": table}, step=step)


def _markdown(r: dict) -> str:
    # Four-space indent makes TensorBoard show the text verbatim (it renders markdown).
    body = "\n".join("    " + line for line in r["response"].splitlines())
    return (
        f"**problem** ({r['key']}): {r['problem']}  \n**gold**: `{r['gold']}` | "
        f"**extracted**: `{r['extracted']}` | **reward** {r['reward']:.2f} | "
        f"**score** {r['score']:.2f}\n\n{body}"
    )
