"""EVOL-RL's novelty reward (arXiv 2509.15194), the memoryless twin of MEDS: a response is compared
with the others of its group, not with the past. ``novelty_i = 1 - (0.5 * mean cos(v_i, same-outcome
others) + 0.5 * max cos(v_i, any other))``, min-max normalised within each outcome to ``u``; reward
``0.5 + 0.5 u`` if right, ``-1 + 0.5 u`` if wrong, -1 without a boxed answer. ``v_i``: the MEDS
feature (so MEDS vs novelty isolates history) or the mean normed last hidden state.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import torch
from torch import Tensor
from typing_extensions import Doc

from medsrl.algo.logprobs import masked_mean
from medsrl.features.logit_capture import find_final_norm
from medsrl.features.reader import AnswerFeatureReader, FeatureSpec
from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import one_of
from medsrl.step.rollouts import StepRollouts


def group_novelty(vectors: Tensor, correct: Tensor) -> Tensor:
    """Per row of one group's ``vectors`` ``[n, D]``; alone in its outcome: mean similarity 0."""
    n = len(vectors)
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    v = torch.nn.functional.normalize(vectors.double(), dim=-1)
    sim = v @ v.T
    other = ~torch.eye(n, dtype=torch.bool)
    same = (correct[:, None] == correct[None, :]) & other
    mean_same = torch.where(same, sim, 0).sum(1) / same.sum(1).clamp(min=1)
    max_any = torch.where(other, sim, -torch.inf).max(1).values
    return 1 - (0.5 * mean_same + 0.5 * max_any)


def minmax_within(values: Tensor, subset: Tensor) -> Tensor:
    """``values`` min-max normalised within ``subset`` to [0, 1] (0.5 without spread), 0 elsewhere."""
    out = torch.zeros_like(values)
    if subset.any():
        x = values[subset]
        lo, hi = x.min(), x.max()
        out[subset] = (x - lo) / (hi - lo) if hi > lo else torch.full_like(x, 0.5)
    return out


def novelty_rewards(vectors: Tensor, correct: Tensor, has_box: Tensor, has_vector: Tensor) -> Tensor:
    """One group's reward; rows without a vector get the bottom of their outcome's range."""
    u = torch.zeros(len(correct), dtype=torch.float64)
    rows = has_vector.nonzero().flatten()
    if len(rows):
        nov = group_novelty(vectors[rows], correct[rows])
        ok = correct[rows]
        u[rows] = minmax_within(nov, ok) + minmax_within(nov, ~ok)
    reward = torch.where(correct, 0.5 + 0.5 * u, -1 + 0.5 * u)
    return torch.where(has_box, reward, torch.full_like(reward, -1.0))


VECTORS = ("meds_features", "hidden_mean")


class NoveltyBonus(Plugin):
    """Replaces the correctness part of each score by EVOL-RL's novelty reward."""

    name = "novelty"
    moved = {**{k: f"features.{k}" for k in FeatureSpec.model_fields}, "feature_dtype": "features.dtype"}

    def __init__(
        self,
        vectors: Annotated[one_of(VECTORS), Doc(
            "meds_features (MEDS's logit features: the twin of MEDS) | hidden_mean (the mean normed "
            "last hidden state; the paper embeds the text with an embedding model, none is loaded "
            "here)")] = "meds_features",
        features: Annotated[FeatureSpec, Doc(
            "MEDS's feature (vectors=meds_features)")] = FeatureSpec(),  # noqa: B008 - never mutated
    ) -> None:
        self.vectors = vectors
        self.features = FeatureSpec.model_validate(features)
        self.reader: AnswerFeatureReader | None = None
        self._norm: torch.nn.Module | None = None
        self._rows: torch.Tensor = torch.zeros(0, dtype=torch.long)
        self._vecs: torch.Tensor = torch.zeros(0, 0)
        self._parts: list[torch.Tensor] = []
        self._part_rows: list[torch.Tensor] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.vectors == "meds_features" and self.reader is None:
            self.reader = AnswerFeatureReader(pl_module.policy, pl_module.tokenizer, self.features,
                                              pl_module.grader_cfg.reasoning_end)
        if self.vectors == "hidden_mean" and self._norm is None:
            self._norm = find_final_norm(pl_module.policy)

    def before_scoring(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        self._parts, self._part_rows = [], []
        if self.reader is not None:
            self.reader.begin(rollouts.response_ids, rollouts.packed.prompt_length)

    def scoring_microbatch(self, rollouts: StepRollouts, rows: torch.Tensor):
        packed = rollouts.packed
        end = packed.columns_end(rows)
        if self.reader is not None:
            return self.reader.microbatch(rows, end)
        return self._hidden_mean(rows, packed.response_mask[rows, : end - packed.prompt_length])

    @contextlib.contextmanager
    def _hidden_mean(self, rows: torch.Tensor, mask: torch.Tensor):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            # the response columns come last (the forward runs none of the right padding past them)
            resp = hidden[:, hidden.shape[1] - mask.shape[1]:].detach().float()
            w = mask.to(resp.device).unsqueeze(-1)
            self._parts.append(((resp * w).sum(1) / w.sum(1).clamp(min=1)).cpu())
            self._part_rows.append(rows.cpu())

        handle = self._norm.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def after_scoring(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        if self.reader is not None:
            self._vecs, self._rows = self.reader.finish()
        else:
            self._vecs = torch.cat(self._parts) if self._parts else torch.zeros(0, 0)
            self._rows = torch.cat(self._part_rows) if self._part_rows else torch.zeros(0, dtype=torch.long)

    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        n = len(rollouts)
        vecs = torch.zeros(n, max(self._vecs.shape[-1], 1), dtype=torch.float64)
        has_vec = torch.zeros(n, dtype=torch.bool)
        if len(self._rows):
            vecs[self._rows] = self._vecs.double()
            has_vec[self._rows] = True
        correct = rollouts.acc > 0.5
        has_box = torch.tensor([g.has_box for g in rollouts.grades], dtype=torch.bool)
        reward = torch.zeros(n, dtype=torch.float64)
        for g in rollouts.group_ids.unique().tolist():
            rows = (rollouts.group_ids == g).nonzero().flatten()
            reward[rows] = novelty_rewards(vecs[rows], correct[rows], has_box[rows], has_vec[rows])
        delta = (reward - rollouts.acc.double()).to(rollouts.scores.dtype)
        rollouts.shape_scores(self.name, rollouts.scores + delta)
        ctx.log(self, {
            "reward_mean": float(reward.mean()),
            "reward_std": float(reward.std()) if n > 1 else 0.0,
            "right_mean": float(masked_mean(reward.float(), correct.float())),  # 0 without any
            "wrong_mean": float(masked_mean(reward.float(), (~correct).float())),
            "vector_rate": float(masked_mean(has_vec.float(), torch.ones(n))),
        })

