"""The plug-in protocol: a Lightning ``Callback`` whose hooks below the module also calls at fixed
points of each step, in ``algorithm.plugins`` order (``docs/PLUGINS.md``). Replicated state: every
rank's ``step_additions`` go to ``commit`` on every rank."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, TensorBoardLogger

from medsrl.utils import wandb_log
from medsrl.utils.run_dir import run_log_dir

if TYPE_CHECKING:
    from medsrl.data.example import Prompt
    from medsrl.step.metrics import PhaseTimer
    from medsrl.step.rollouts import Group, StepRollouts


@dataclass
class StepContext:
    """What a plug-in may use during one step; ``loggers`` and ``run_dir`` are rank 0's only."""

    step: int
    stage: str | None
    timer: PhaseTimer
    num_prompts: int  # the step's global prompt count (the batch to fill)
    loggers: list[Logger] = field(default_factory=list)  # for histograms and text
    run_dir: str | None = None  # the run's log directory, for snapshot files
    metrics: dict[str, float] = field(default_factory=dict)  # logged under train/
    # the groups a filter took out of the batch (DAPO's), which a later plug-in may learn from
    dropped: list[Group] = field(default_factory=list)
    # the policy the scoring pass runs, while it runs (under FSDP its wrapper: an own forward is a collective)
    scoring_policy: Any = None

    @classmethod
    def for_trainer(cls, trainer, step: int, stage: str | None, timer: PhaseTimer, num_prompts: int) -> StepContext:
        if not trainer.is_global_zero:
            return cls(step, stage, timer, num_prompts)
        return cls(step, stage, timer, num_prompts, list(trainer.loggers), run_log_dir(trainer))

    def log(self, plugin: Plugin, values: dict[str, float]) -> None:
        """Scalars as ``train/<plugin name>/<key>``."""
        self.metrics.update({f"{plugin.name}/{k}": v for k, v in values.items()})

    def _writers(self):
        return [lg.experiment for lg in self.loggers if isinstance(lg, TensorBoardLogger)]

    def histogram(self, plugin: Plugin, tag: str, values) -> None:
        """A histogram ``<plugin name>/<tag>`` in TensorBoard and W&B (rank 0; else a no-op)."""
        for w in self._writers():
            w.add_histogram(f"{plugin.name}/{tag}", values, global_step=self.step)
        wandb_log.log_histogram(self.loggers, f"{plugin.name}/{tag}", values, self.step)

    def text(self, plugin: Plugin, tag: str, text: str) -> None:
        """A text panel ``<plugin name>/<tag>`` in TensorBoard and W&B (rank 0)."""
        for w in self._writers():
            w.add_text(f"{plugin.name}/{tag}", text, self.step)
        wandb_log.log_text(self.loggers, f"{plugin.name}/{tag}", text, self.step)


class Plugin(Callback):
    """Base class of training-method plug-ins; every hook is a no-op by default."""

    name: str = "plugin"  # set from its key in ``algorithm.plugins``
    token_stats: tuple[str, ...] = ()  # per-token quantities from the scoring forward
    # Reads the scoring forward; only when no plug-in does may an on-policy step skip it
    reads_scoring_forward: bool = True
    # A filter whose step generates up to this many extra rounds to refill the batch (DAPO)
    max_rounds: int | None = None

    @property
    def state_key(self) -> str:
        return f"plugin:{self.name}"

    # before generation and packing ------------------------------------------------------
    def add_prompts(self, prompts: list[Prompt], ctx: StepContext) -> list[Prompt]:
        """Extra prompts to generate in this step (the same list on every rank)."""
        return []

    def transform_groups(self, groups: list[Group], ctx: StepContext) -> list[Group]:
        """The step's groups (this rank's share), changed; return the list to keep. Before DAPO's
        filter: called once per generation round (``PluginHost.fill_batch``)."""
        return groups

    def batch_filled(self, extra_rounds: int, kept: float, ctx: StepContext) -> None:
        """After the rounds of a filter with ``max_rounds``: ``kept`` groups over all ranks."""

    # the scoring forward -------------------------------------------------------------------
    def token_reducers(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """Own per-token quantities: ``name -> fn(logits [b,R,V], labels [b,R]) -> [b,R]``."""
        return {}

    def before_scoring(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        """Before the no-grad forward (e.g. locate what to capture)."""

    def scoring_microbatch(self, rollouts: StepRollouts, rows: torch.Tensor) -> AbstractContextManager:
        """A context around the forward of the packed ``rows`` (ascending; e.g. capture hooks).
        That forward runs the columns up to ``rollouts.packed.columns_end(rows)`` only."""
        return nullcontext()

    def after_scoring(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        """After it: ``rollouts.old_logp`` and ``rollouts.token_stats`` are filled."""

    # rewards, replicated state, advantages ------------------------------------------------------
    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        """Add reward terms (``rollouts.add_reward``) or shape scores (``shape_scores``)."""

    def step_additions(self, rollouts: StepRollouts, ctx: StepContext) -> Any:
        """What this rank adds to the replicated state this step (picklable); None: nothing."""
        return None

    def commit(self, additions: list[Any], ctx: StepContext) -> None:
        """Apply every rank's additions, in rank order (identical on every rank); additions made as an
        ``InStepOrder`` read through ``in_step_order`` come in the step's order (``step/balance.py``)."""

    def digest(self) -> str:
        """A hash of the replicated state, compared across ranks to catch divergence."""
        return hashlib.sha1(pickle.dumps(self.state_dict())).hexdigest()

    def shape_advantages(self, rollouts: StepRollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Advantages ``[B]`` or ``[B, R]``, changed; may also set ``rollouts.loss_weights``."""
        return advantages
