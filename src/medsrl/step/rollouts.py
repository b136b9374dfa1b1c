"""The rollouts of one RL step: the graded groups before packing (:class:`Group`, which plug-ins
may filter or extend), the packed batch after (:class:`StepRollouts`, whose rewards they shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from medsrl.algo import keep_mask_by_group_spread
from medsrl.rollout.base import PackedRollouts, RolloutBatch, pack_rollouts

if TYPE_CHECKING:
    from medsrl.data.example import Prompt
    from medsrl.reward.grader import GradeResult

SAMPLED = "sampled"  # Group.source of rows the engine generated this step


@dataclass
class Group:
    """One prompt's graded responses in this step (``rollout``'s ``prompt_index`` all 0).
    ``source`` per row: ``"sampled"`` or the plug-in that added it (R3's replayed rows)."""

    prompt: Prompt
    rollout: RolloutBatch
    grades: list[GradeResult]
    source: list[str]
    kept_by: str | None = None  # a plug-in that gives this zero-spread group a signal (R3)
    # (round, its prompt's position in the round): the step's order of groups on any number of ranks
    origin: tuple[int, int] | None = None
    index: int | None = None  # its place in the step's batch over all ranks (step/balance.py)

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def acc(self) -> torch.Tensor:
        return torch.tensor([g.score for g in self.grades], dtype=torch.float32)

    @property
    def has_spread(self) -> bool:
        """Whether the rows differ in accuracy (else every advantage is 0: DAPO drops it)."""
        acc = self.acc
        return bool(keep_mask_by_group_spread(acc, torch.zeros(len(acc), dtype=torch.long)).any())

    @property
    def trainable(self) -> bool:
        """What DAPO's filter keeps: its accuracy has spread, or a plug-in (``kept_by``) will shape
        its scores apart (R3's ranking of an all-wrong group)."""
        return self.has_spread or self.kept_by is not None

    def add_rows(self, rows: RolloutBatch, grades: list[GradeResult], source: str) -> None:
        if len(rows) != len(grades):
            raise ValueError(f"add_rows: {len(rows)} rows but {len(grades)} grades")
        self.rollout = RolloutBatch.concat_groups([self.rollout, rows])
        self.rollout.prompt_index = [0] * len(self.rollout)
        self.grades = self.grades + list(grades)
        self.source = self.source + [source] * len(rows)


def split_groups(prompts: list[Prompt], rollout: RolloutBatch, grades: list,
                 origin: tuple[int, int] | None = None) -> list[Group]:
    """One :class:`Group` per prompt of a generated batch, in prompt order; ``origin``: that of
    ``prompts[0]``, the others' counting on from it."""
    rows_of: dict[int, list[int]] = {}
    for i, p in enumerate(rollout.prompt_index):
        rows_of.setdefault(p, []).append(i)
    return [
        Group(prompts[g], rollout.select(rows), [grades[i] for i in rows], [SAMPLED] * len(rows),
              origin=None if origin is None else (origin[0], origin[1] + g))
        for g, rows in sorted(rows_of.items())
    ]


@dataclass
class StepRollouts:
    """Everything one step produced, one row per response: ``reward`` is graded (correctness plus
    terms such as overlong); ``scores`` adds shaping (MEDS) and makes the advantages; ``terms``
    are its named components (``correct`` first), for GDPO."""

    step: int
    stage: str | None
    prompts: list[Prompt]  # one per group
    group_ids: torch.Tensor  # long [B], index into ``prompts``
    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    grades: list[GradeResult]
    source: list[str]  # per row, see Group.source
    packed: PackedRollouts
    acc: torch.Tensor  # float [B], 1.0 when the answer is right
    reward: torch.Tensor  # float [B]
    scores: torch.Tensor  # float [B]
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float [B]
    old_logp: torch.Tensor | None = None  # [B, R]
    ref_logp: torch.Tensor | None = None  # [B, R]
    engine_logp: torch.Tensor | None = None  # [B, R] sampling (or replayed behaviour) log-probs
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, R], old policy
    loss_weights: torch.Tensor | None = None  # [B, R] per-token loss weights (None: all 1)
    shaping: list[str] = field(default_factory=list)  # the terms shape_scores added (not rewards)
    group_index: list[int | None] = field(default_factory=list)  # per group: Group.index (step/balance.py)
    origins: list[tuple[int, int] | None] = field(default_factory=list)  # per group: Group.origin

    @classmethod
    def from_groups(cls, groups: list[Group], step: int, stage: str | None, pad_token_id: int, device) -> StepRollouts:
        merged = RolloutBatch.concat_groups([g.rollout for g in groups])
        packed = pack_rollouts(merged.prompt_ids, merged.response_ids, pad_token_id)
        grades = [gr for g in groups for gr in g.grades]
        acc = torch.tensor([g.score for g in grades], dtype=torch.float32)
        return cls(
            step=step, stage=stage, prompts=[g.prompt for g in groups],
            group_ids=torch.tensor(merged.prompt_index, dtype=torch.long),
            response_ids=merged.response_ids, response_text=merged.response_text,
            finish_reason=merged.finish_reason, grades=grades,
            source=[s for g in groups for s in g.source], packed=packed.to(device),
            acc=acc, reward=acc.clone(), scores=acc.clone(), terms={"correct": acc.clone()},
            engine_logp=_padded(merged.response_logprobs, packed.response_length, device),
            group_index=[g.index for g in groups], origins=[g.origin for g in groups],
        )

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def keys(self) -> list[str]:
        return [self.prompts[g].key for g in self.group_ids.tolist()]

    def add_reward(self, name: str, delta: torch.Tensor) -> None:
        """A reward term (e.g. the overlong penalty): changes ``reward`` and ``scores`` alike."""
        delta = delta.to(self.reward.dtype)
        self.reward = self.reward + delta
        self.scores = self.scores + delta
        self.terms[name] = self.terms[name] + delta if name in self.terms else delta

    def shape_scores(self, name: str, shaped: torch.Tensor) -> None:
        """Shaping (e.g. the MEDS penalty): ``scores`` becomes ``shaped``; ``reward`` stays."""
        delta = shaped - self.scores
        self.scores = shaped
        self.terms[name] = self.terms[name] + delta if name in self.terms else delta
        if name not in self.shaping:
            self.shaping.append(name)

    def unshaped_terms(self) -> dict[str, torch.Tensor]:
        """The reward terms without the shaping ones: they sum to ``reward``."""
        return {k: v for k, v in self.terms.items() if k not in self.shaping}


def _padded(rows: list[list[float]] | None, width: int, device) -> torch.Tensor | None:
    if rows is None:
        return None
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out.to(device)
