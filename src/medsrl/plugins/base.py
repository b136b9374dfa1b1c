"""The plug-in protocol: how a training method takes part in the RL step.

A plug-in is a Lightning ``Callback`` (so setup, teardown and checkpoint state are Lightning's)
that the module also calls at fixed points of each step, in the order of
``algorithm.plugins``. Override only what the method needs::

    add_prompts        prompts to generate this step, besides the batch's (R3 reflection)
    transform_groups   graded groups before packing: drop (DAPO), add rows (replay) or groups;
                       called again for each extra generation round of a later plug-in (DAPO)
    token_stats        names of per-token quantities wanted from the scoring forward
                       ("entropy" built in; a plug-in's own via ``token_reducers``)
    before_scoring / scoring_microbatch / after_scoring
                       around the one no-grad old-log-prob forward (MEDS reads hidden states)
    shape_rewards      reward terms and shaped scores, before advantages (overlong, MEDS)
    step_additions / commit
                       replicated state: what this rank adds this step; ``commit`` gets every
                       rank's additions (one all-gather for all plug-ins), so state is identical
                       on every rank; ``state_dict`` puts it into checkpoints
    shape_advantages   token-level advantages ([B] or [B, T]) and ``rollouts.loss_weights``

Metrics, histograms and text go through the :class:`StepContext`, under the plug-in's name.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from medsrl.utils import wandb_log

if TYPE_CHECKING:
    from medsrl.data.example import Prompt
    from medsrl.step.metrics import PhaseTimer
    from medsrl.step.rollouts import Group, StepRollouts


@dataclass
class StepContext:
    """What a plug-in may use during one step.

    ``sample(prompts, round)`` generates and grades this rank's share of ``prompts`` (seeded by
    step and round) and returns them as groups; ``metrics`` is logged under ``train/``.
    ``dropped`` holds the groups a filter took out of the batch (DAPO's zero-spread groups):
    never trained on, but a later plug-in may learn from them. ``scoring_policy`` is the policy
    with all its weights while the scoring block runs (for a plug-in's own no-grad forward).
    """

    trainer: Any
    module: Any
    step: int
    stage: str | None
    timer: PhaseTimer
    sample: Callable[[list[Prompt], int], list[Group]]
    num_prompts: int  # the step's global prompt count (the batch to fill)
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: list[Group] = field(default_factory=list)
    scoring_policy: Any = None

    def log(self, plugin: Plugin, values: dict[str, float]) -> None:
        """Scalars as ``train/<plugin name>/<key>``."""
        for k, v in values.items():
            self.metrics[f"{plugin.name}/{k}"] = v

    def _writers(self):
        if not self.trainer.is_global_zero:
            return []
        return [lg.experiment for lg in self.trainer.loggers if isinstance(lg, TensorBoardLogger)]

    def _wandb_loggers(self) -> list:
        return wandb_log.wandb_loggers(self.trainer.loggers) if self.trainer.is_global_zero else []

    def histogram(self, plugin: Plugin, tag: str, values) -> None:
        """A histogram ``<plugin name>/<tag>`` in TensorBoard and W&B (rank 0; no-op without
        either logger)."""
        for w in self._writers():
            w.add_histogram(f"{plugin.name}/{tag}", values, global_step=self.step)
        wandb_log.log_histogram(self._wandb_loggers(), f"{plugin.name}/{tag}", values, self.step)

    def text(self, plugin: Plugin, tag: str, text: str) -> None:
        """A text panel ``<plugin name>/<tag>`` in TensorBoard and W&B (rank 0)."""
        for w in self._writers():
            w.add_text(f"{plugin.name}/{tag}", text, self.step)
        wandb_log.log_text(self._wandb_loggers(), f"{plugin.name}/{tag}", text, self.step)


class Plugin(Callback):
    """Base class of training-method plug-ins; every hook is a no-op by default."""

    name: str = "plugin"  # set from its key in ``algorithm.plugins``
    token_stats: tuple[str, ...] = ()  # per-token quantities from the scoring forward
    # Reads the scoring forward (old log-probs, token stats, capture hooks). Only when no plug-in
    # does may an on-policy step skip that forward (``RLModule.scoring_forward_needed``).
    reads_scoring_forward: bool = True
    legacy_state_keys: tuple[str, ...] = ()  # where checkpoints of older versions kept the state

    @property
    def state_key(self) -> str:
        return f"plugin:{self.name}"

    # before generation and packing ------------------------------------------------------
    def add_prompts(self, prompts: list[Prompt], ctx: StepContext) -> list[Prompt]:
        """Extra prompts to generate in this step (the same list on every rank)."""
        return []

    def transform_groups(self, groups: list[Group], ctx: StepContext) -> list[Group]:
        """The step's groups (this rank's share), changed; return the list to keep. Called once
        per generation round: again for the groups of a later plug-in's extra rounds."""
        return groups

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
        """Apply every rank's additions, in rank order (identical on every rank)."""

    def digest(self) -> str:
        """A hash of the replicated state, compared across ranks to catch divergence."""
        return hashlib.sha1(pickle.dumps(self.state_dict())).hexdigest()

    def shape_advantages(self, rollouts: StepRollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Advantages ``[B]`` or ``[B, R]``, changed; may also set ``rollouts.loss_weights``."""
        return advantages
