"""Outcome-based exploration, historical (arXiv 2509.06941): each response's score gains
``c / sqrt(1 + N)``, ``N`` the times its prompt's responses gave the same final answer in earlier
steps (counted as MEDS's ``mode=answer``, but right answers too), so a rarely reached answer pays
more. Counts are updated after the step, from every rank: two responses of one step with the same
answer get the same bonus (the paper's batch exploration is not this plug-in). With DAPO's filter
the dropped groups count too (``count_dropped``).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from typing_extensions import Doc

from medsrl.methods.meds.gate import answer_counts_digest, count_answers, earlier_answer_counts
from medsrl.plugins.base import Plugin, StepContext
from medsrl.settings import Flag, NonNegative
from medsrl.step.rollouts import SAMPLED, StepRollouts


def ucb_bonus(counts: list[int], answered: list[bool], c: float) -> torch.Tensor:
    """Per response (float64 [B]); 0 where there is no answer."""
    return torch.tensor([c / math.sqrt(1 + n) if ok else 0.0 for n, ok in zip(counts, answered, strict=True)],
                        dtype=torch.float64)


class OutcomeUCB(Plugin):
    """Adds the historical outcome bonus to each response's score (a score term ``outcome_ucb``)."""

    name = "outcome_ucb"
    reads_scoring_forward = False  # the grades only

    def __init__(
        self,
        c: Annotated[NonNegative, Doc(
            "scale of the bonus c / sqrt(1 + N(prompt, answer)); not found in the paper's text "
            "reachable here: 0.5, half the 0/1 correctness reward, for an answer never seen")] = 0.5,
        count_dropped: Annotated[Flag, Doc(
            "also count the answers of the groups DAPO's filter dropped (sampled, never trained "
            "on); false: the trained batch's only")] = True,
    ) -> None:
        self.c = c
        self.count_dropped = count_dropped
        # per prompt key, how often each extracted answer was given in earlier steps (every rank)
        self.answer_counts: dict[str, dict[str, int]] = {}

    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        answers = [g.extracted for g in rollouts.grades]
        counts = earlier_answer_counts(rollouts.keys, answers, self.answer_counts)
        answered = [a is not None for a in answers]
        bonus = ucb_bonus(counts, answered, self.c)
        rollouts.shape_scores(self.name, rollouts.scores + bonus.to(rollouts.scores.dtype))
        n = max(len(answers), 1)
        ctx.log(self, {
            "bonus_mean": float(bonus.mean()) if len(bonus) else 0.0,
            "new_answer_frac": sum(ok and k == 0 for ok, k in zip(answered, counts, strict=True)) / n,
            "answered_frac": sum(answered) / n,
        })

    def step_additions(self, rollouts: StepRollouts, ctx: StepContext) -> list[tuple[str, str | None]]:
        """This rank's ``(prompt key, answer)`` of the responses it sampled (not R3's replays)."""
        keyed = [(k, g.extracted) for k, g, src in zip(rollouts.keys, rollouts.grades, rollouts.source, strict=True)
                 if src == SAMPLED]
        if self.count_dropped:
            keyed += [(group.prompt.key, g.extracted) for group in ctx.dropped
                      for g, src in zip(group.grades, group.source, strict=True) if src == SAMPLED]
        return keyed

    def commit(self, additions: list, ctx: StepContext) -> None:
        """Every rank's answers into the counts (a sum: in any order)."""
        for keyed in additions:
            count_answers(self.answer_counts, keyed)
        ctx.log(self, {"prompts_known": float(len(self.answer_counts)),
                       "answers_known": float(sum(len(v) for v in self.answer_counts.values()))})

    def state_dict(self) -> dict:
        return {"answer_counts": {k: dict(v) for k, v in self.answer_counts.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.answer_counts = {k: dict(v) for k, v in state_dict["answer_counts"].items()}

    def digest(self) -> str:
        return answer_counts_digest(self.answer_counts)
