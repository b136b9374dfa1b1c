"""R3 (arXiv 2601.19620) as one plug-in: replay (CCR, ``transform_groups``), reflection (ISR,
``add_prompts``) and ranking (SERR, ``shape_rewards``) over a replicated per-prompt response history
(``r3/``; the paper's rules and our defaults for its gaps: docs/REFERENCE.md, docs/R3.md). They act
on a prompt seen in ``min_visits`` earlier steps, from ``start_step`` on (the paper: epoch 2).
Place R3 before ``dynamic_sampling``, so that a group it rescues counts as kept.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from typing_extensions import Doc

from medsrl.algo import per_token
from medsrl.algo.engine_correction import truncated_is_weights
from medsrl.methods.r3.history import ResponseHistory, StoredResponse
from medsrl.methods.r3.length_bonus import length_bonus as correct_length_bonus
from medsrl.methods.r3.ranking import answer_span_mask, entropy_profile, ranking_rewards
from medsrl.methods.r3.reflection import DEFAULT_INSTRUCTION, is_reflection, reflection_prompt
from medsrl.methods.r3.replay import mixed_group_advantages, replay_count
from medsrl.plugins.base import Plugin, StepContext
from medsrl.reward.answer_span import answer_starts
from medsrl.reward.grader import GradeResult
from medsrl.rollout.base import RolloutBatch
from medsrl.settings import Count, Flag, Fraction, NonNegative, Number, Positive, PositiveInt, Settings, Text, nullable
from medsrl.step.balance import InStepOrder, in_step_order
from medsrl.step.rollouts import SAMPLED, Group, StepRollouts

log = logging.getLogger(__name__)


class ReplaySettings(Settings):
    enabled: Flag = True
    """Whether replay (CCR) acts."""
    k: nullable(PositiveInt) = None
    """Stored opposite-outcome responses mixed in; null: n // 4, at least 1 (ours)."""
    alpha: NonNegative = 1.0
    """A = (R - mean) / (alpha * std + lam) over the mixed group (ours: 1)."""
    lam: Positive = 1e-6
    """The lam of that normalisation, which bounds A when the group's spread is tiny (ours)."""
    importance_cap: nullable(Positive) = None
    """Truncated importance weights min(pi_old / pi_behaviour, cap) on replayed responses; null:
    off, as in the paper; 2.0 to turn them on (ours)."""


class ReflectionSettings(Settings):
    enabled: Flag = True
    """Whether reflection (ISR) acts."""
    tau: nullable(Number) = None
    """A stored mean reward below tau triggers it; null: 1 / rollout.n (ours)."""
    instruction: Text = DEFAULT_INSTRUCTION
    """What the reflection prompt asks after showing a stored wrong response."""
    max_prompts: nullable(Count) = None
    """Cap on reflection prompts per step; null: no cap (one per qualifying prompt)."""


class RankingSettings(Settings):
    enabled: Flag = True
    """Whether ranking (SERR) acts (off: R3 asks the scoring forward for no token entropies)."""
    p: Fraction = 0.2
    """E_peak = mean of the top max(1, floor(p * L)) token entropies of a response (ours)."""
    r_max: NonNegative = 0.5
    """Reward of the best-ranked wrong response, below a right one's 1 (ours)."""


class R3(Plugin):
    """Replay (CCR), reflection (ISR) and ranking (SERR), each switchable, sharing one history."""

    name = "r3"

    def __init__(
        self,
        replay: Annotated[ReplaySettings, Doc(
            "cross-context replay (CCR) into groups whose rewards are all equal")] = ReplaySettings(),  # noqa: B008
        reflection: Annotated[ReflectionSettings, Doc(
            "in-context self-reflection (ISR): one extra prompt per failing prompt"
        )] = ReflectionSettings(),  # noqa: B008 - never mutated
        ranking: Annotated[RankingSettings, Doc(
            "structural entropy ranking reward (SERR) for all-wrong groups")] = RankingSettings(),  # noqa: B008
        cap_per_key: Annotated[nullable(PositiveInt), Doc(
            "stored responses per prompt, oldest out; null: unbounded (a checkpoint holds every "
            "stored response's tokens and log-probs)")] = 16,
        min_visits: Annotated[Count, Doc(
            "act on a prompt once seen in this many earlier steps (paper: epoch 2)")] = 1,
        start_step: Annotated[Count, Doc("and not before this step")] = 0,
        snapshot_every_n_steps: Annotated[Count, Doc(
            "write the history to <snapshot_dir>/r3/history.parquet (pandas.read_parquet) every N "
            "steps (rank 0); 0: never")] = 20,
        panels_every_n_steps: Annotated[Count, Doc(
            "TensorBoard text of a reflection prompt and its response, at most every N steps; "
            "0: never")] = 10,
        snapshot_dir: Annotated[nullable(Text), Doc(
            "where history snapshots go; null: the run's log dir")] = None,
        length_bonus: Annotated[nullable(PositiveInt), Doc(
            "correct answers earn max(0, 1 - length / this), lengths in tokens (paper: 32768 tokens; "
            "experiment=r1-distill-1.5b_r3 sets it); null: off")] = None,
    ) -> None:
        # Hydra passes mappings: the same schema turns them into settings (config.plugin_problems)
        self.replay = ReplaySettings.model_validate(replay)
        self.reflection = ReflectionSettings.model_validate(reflection)
        self.ranking = RankingSettings.model_validate(ranking)
        self.length_bonus = length_bonus
        self.history = ResponseHistory(cap_per_key)
        self.min_visits, self.start_step = min_visits, start_step
        self.snapshot_every_n_steps, self.panels_every_n_steps = snapshot_every_n_steps, panels_every_n_steps
        self.snapshot_dir = snapshot_dir
        self.token_stats = ("entropy",) if self.ranking.enabled else ()
        self._step = -1
        self._seen: list[tuple[str, Group]] = []  # this rank's sampled groups of the step
        self._counts: dict[str, float] = {}
        self._behaviour: dict[tuple[str, tuple[int, ...]], list] = {}  # replayed rows' log-probs
        self._panel_step = -(10**9)
        self._tokenizer, self._reasoning_end = None, None  # the span ranking reads (setup)

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Ranking reads the span the grader reads (grader.reasoning_end; reward/answer_span.py).
        self._tokenizer, self._reasoning_end = pl_module.tokenizer, pl_module.grader_cfg.reasoning_end
        # reflection: tau's default 1/n, the seed of its picks, the data's prompt template
        self._n, self._seed = pl_module.rollout_cfg.n, pl_module.seed
        self._render = getattr(trainer.datamodule, "render", None)

    def state_dict(self) -> dict:
        return {"history": self.history.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history.load_state_dict(state_dict["history"])

    def digest(self) -> str:
        return self.history.digest()

    def active(self, key: str, step: int) -> bool:
        return step >= self.start_step and self.history.visits(key) >= self.min_visits

    def _begin(self, ctx: StepContext) -> None:
        if ctx.step != self._step:
            self._step, self._seen, self._behaviour = ctx.step, [], {}
            self._counts = dict.fromkeys(
                ["replay/rescued_groups", "replay/rows", "ranking/marked_groups",
                 "reflection/groups", "reflection/correct", "reflection/rows"], 0.0)

    def add_prompts(self, prompts: list, ctx: StepContext) -> list:
        self._begin(ctx)
        cfg = self.reflection
        if not cfg.enabled:
            return []
        tau = cfg.tau if cfg.tau is not None else 1.0 / self._n
        extra = []
        for prompt in prompts:
            if cfg.max_prompts is not None and len(extra) >= cfg.max_prompts:
                break
            if is_reflection(prompt) or not self.active(prompt.key, ctx.step):
                continue
            mean = self.history.mean_reward(prompt.key)
            wrong = [r for r in self.history.responses(prompt.key) if not r.correct]
            if mean is None or mean >= tau or not wrong:
                continue
            pick = wrong[_rng(self._seed, ctx.step, prompt.key).integers(len(wrong))]
            extra.append(reflection_prompt(prompt, pick.text, cfg.instruction, self._render))
        ctx.log(self, {"reflection/prompts": float(len(extra))})
        return extra

    def transform_groups(self, groups: list[Group], ctx: StepContext) -> list[Group]:
        self._begin(ctx)
        for g in groups:
            if is_reflection(g.prompt):
                self._note_reflection(g, ctx)
            else:
                self._seen.append((g.prompt.key, g))
            if g.has_spread or not self.active(g.prompt.key, ctx.step):
                continue
            all_correct = bool(g.acc[0] > 0.5)
            if self.replay.enabled and self._replay_into(g, all_correct, ctx):
                continue
            if self.ranking.enabled and not all_correct and len(g) > 1:
                g.kept_by = self.name
                self._counts["ranking/marked_groups"] += 1
        c = self._counts
        ctx.log(self, {**c, "reflection/acc": c["reflection/correct"] / max(c["reflection/rows"], 1.0)})
        return groups

    def _replay_into(self, g: Group, all_correct: bool, ctx: StepContext) -> bool:
        """Stored opposite-outcome responses into zero-spread group ``g``; False: none stored."""
        k = replay_count(self.replay.k, len(g))
        picks = self.history.recent(g.prompt.key, correct=not all_correct, k=k)  # newest first
        if not picks:
            return False
        prompt_ids = g.rollout.prompt_ids[0]
        rows = RolloutBatch(
            prompt_index=[0] * len(picks),
            prompt_ids=[list(prompt_ids) for _ in picks],
            response_ids=[list(r.token_ids) for r in picks],
            response_text=[r.text for r in picks],
            finish_reason=[r.finish_reason for r in picks],
        )
        grades = [GradeResult(float(r.correct), r.extracted, r.has_box) for r in picks]
        g.add_rows(rows, grades, self.name)
        for r in picks:  # found again after packing by (key, tokens), in row order
            self._behaviour.setdefault((g.prompt.key, r.token_ids), []).append(r.logprobs)
        self._counts["replay/rescued_groups"] += 1
        self._counts["replay/rows"] += len(picks)
        return True

    def _note_reflection(self, g: Group, ctx: StepContext) -> None:
        self._counts["reflection/groups"] += 1
        self._counts["reflection/rows"] += len(g)
        self._counts["reflection/correct"] += float(g.acc.sum())
        every = self.panels_every_n_steps
        if every and ctx.step - self._panel_step >= every:  # the first one, then every `every` steps
            self._panel_step = ctx.step
            best = int(torch.argmax(g.acc))
            ctx.text(self, "reflection", (
                f"**reflection prompt** (gold `{g.prompt.answer}`):\n\n    "
                + g.prompt.problem[:1500].replace("\n", "\n    ")
                + f"\n\n**response** ({'right' if g.acc[best] > 0.5 else 'wrong'}, "
                f"{int(g.acc.sum())}/{len(g)} of the group right):\n\n    "
                + g.rollout.response_text[best][:1500].replace("\n", "\n    ")
            ))

    def shape_rewards(self, rollouts: StepRollouts, ctx: StepContext) -> None:
        if self.length_bonus is not None:
            lengths = torch.tensor([len(r) for r in rollouts.response_ids])
            length_reward = correct_length_bonus(lengths, rollouts.acc.cpu() > 0.5, self.length_bonus)
            rollouts.add_reward("length_bonus", length_reward)
        if not self.ranking.enabled:
            return
        bonus = torch.zeros(len(rollouts), dtype=torch.float64)
        mask = rollouts.packed.response_mask.cpu()
        if self._reasoning_end is not None:
            mask = answer_span_mask(mask, answer_starts(rollouts.response_ids, self._tokenizer, self._reasoning_end))
        entropy = rollouts.token_stats["entropy"].cpu()
        groups = ranked = 0
        for g, prompt in enumerate(rollouts.prompts):
            rows = (rollouts.group_ids == g).nonzero().flatten()
            if len(rows) < 2 or bool((rollouts.acc[rows] > 0.5).any()) or not self.active(prompt.key, ctx.step):
                continue
            peak, glob = entropy_profile(entropy[rows], mask[rows], self.ranking.p)
            bonus[rows] = ranking_rewards(peak, glob, self.ranking.r_max)
            groups, ranked = groups + 1, ranked + len(rows)
        if groups:
            rollouts.shape_scores("serr", rollouts.scores + bonus.to(rollouts.scores.dtype))
        ctx.log(self, {"ranking/groups": float(groups), "ranking/rows": float(ranked)})

    def step_additions(self, rollouts: StepRollouts, ctx: StepContext) -> list[tuple[str, StoredResponse]]:
        """This rank's sampled responses, with reward and behaviour log-probs where they were scored
        (a dropped group: its correctness, none); a group moved between ranks (``step/balance.py``)
        is told by the rank that scored it, in its place in the step."""
        packed: dict[tuple[str, tuple[int, ...]], int] = {}
        keys = rollouts.keys
        for i, ids in enumerate(rollouts.response_ids):
            if rollouts.source[i] == SAMPLED:
                packed.setdefault((keys[i], tuple(ids)), i)
        old_logp = rollouts.old_logp.float().cpu() if rollouts.old_logp is not None else None

        def stored(text: str, ids: tuple[int, ...], finish_reason: str, grade: GradeResult, i: int | None):
            """The response for the history: reward and log-probs of its scored row ``i``, else its correctness."""
            scored = i is not None and old_logp is not None
            return StoredResponse(
                token_ids=ids, text=text, reward=float(rollouts.reward[i]) if scored else float(grade.score),
                correct=grade.score > 0.5, step=ctx.step, finish_reason=finish_reason, extracted=grade.extracted,
                has_box=grade.has_box, logprobs=tuple(old_logp[i][: len(ids)].tolist()) if scored else None,
            )

        held = set(rollouts.group_index) - {None}
        out, order = [], []
        for key, g in self._seen:
            if g.index is not None and g.index not in held:
                continue  # moved to another rank: that one tells it, scored
            for j in range(len(g)):
                if g.source[j] != SAMPLED:
                    continue
                ids = tuple(g.rollout.response_ids[j])
                out.append((key, stored(g.rollout.response_text[j], ids, g.rollout.finish_reason[j], g.grades[j],
                                        packed.get((key, ids)))))
                order.append(None if g.origin is None else (*g.origin, j))
        mine = {g.index for _, g in self._seen} - {None}
        group_ids = rollouts.group_ids.tolist()
        first: dict[int, int] = {}
        for i, gid in enumerate(group_ids):  # the rows of groups another rank sampled and moved here
            first.setdefault(gid, i)
            index = rollouts.group_index[gid] if rollouts.group_index else None
            if index is None or index in mine or rollouts.source[i] != SAMPLED or is_reflection(rollouts.prompts[gid]):
                continue
            out.append((keys[i], stored(rollouts.response_text[i], tuple(rollouts.response_ids[i]),
                                        rollouts.finish_reason[i], rollouts.grades[i], i)))
            origin = rollouts.origins[gid]
            order.append(None if origin is None else (*origin, i - first[gid]))
        return InStepOrder(out, order)

    def commit(self, additions: list, ctx: StepContext) -> None:
        for key, response in in_step_order(additions):  # one process's order (step/balance.py)
            self.history.add(key, response)
        self._seen = []
        ctx.log(self, {
            "history/responses": float(self.history.num_responses()),
            "history/keys": float(self.history.num_keys()),
        })
        every = self.snapshot_every_n_steps
        if every and (ctx.step + 1) % every == 0 and ctx.run_dir is not None:  # rank 0 writes
            path = Path(self.snapshot_dir or ctx.run_dir) / "r3" / "history.parquet"
            self.history.snapshot(path)
            log.info("R3 history snapshot at step %d: %s (%d responses)", ctx.step, path,
                     self.history.num_responses())

    def shape_advantages(self, rollouts: StepRollouts, advantages: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Replay's normalisation of each mixed group; importance weights of replayed rows."""
        replayed = torch.tensor([s == self.name for s in rollouts.source], dtype=torch.bool)
        if not replayed.any():
            return advantages
        mixed = torch.isin(rollouts.group_ids, rollouts.group_ids[replayed].unique())
        adv = mixed_group_advantages(rollouts.scores, rollouts.group_ids, self.replay.alpha, self.replay.lam)
        adv = per_token(adv.to(advantages.device, advantages.dtype), advantages)  # [B, 1] or [B]
        mixed = per_token(mixed.to(advantages.device), advantages)
        advantages = torch.where(mixed, adv, advantages)
        if self.replay.importance_cap is not None:
            self._importance_weights(rollouts, replayed, ctx)
        return advantages

    def _importance_weights(self, rollouts: StepRollouts, replayed: torch.Tensor, ctx: StepContext) -> None:
        mask = rollouts.packed.response_mask
        behaviour = rollouts.old_logp.detach().clone()  # weight 1 where none was stored
        missing = 0
        keys = rollouts.keys
        for i in replayed.nonzero().flatten().tolist():
            ids = tuple(rollouts.response_ids[i])
            lps = self._behaviour[(keys[i], ids)].pop(0)
            if lps is None:
                missing += 1
            else:
                behaviour[i, : len(ids)] = torch.as_tensor(lps, dtype=behaviour.dtype)
        w = truncated_is_weights(rollouts.old_logp, behaviour, self.replay.importance_cap, mask)
        rows = replayed.to(w.device)
        w = torch.where(rows.unsqueeze(-1), w, torch.ones_like(w))
        rollouts.loss_weights = w if rollouts.loss_weights is None else rollouts.loss_weights * w
        sel = mask.bool() & rows.unsqueeze(-1)
        ctx.log(self, {
            "replay/is_weight_mean": float(w[sel].mean()) if sel.any() else 1.0,
            "replay/is_capped_frac": float((w[sel] >= self.replay.importance_cap).float().mean()) if sel.any() else 0.0,
            "replay/rows_without_logprobs": float(missing),
        })


def _rng(seed: int, step: int, key: str) -> np.random.Generator:
    """The same pick on every rank and on resume."""
    digest = hashlib.sha256(f"{seed}:{step}:{key}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))

