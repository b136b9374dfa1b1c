"""The LightningModule: one GRPO/DAPO step, from prompts to a policy update.

The math lives in ``medsrl.algo`` (pure functions); this module only orders the phases,
moves tensors and logs. One training step (``trainer.global_step`` counts these) is:

    generate -> grade -> [dynamic sampling: more prompts] -> pack -> no-grad forward for old
    log-probs (rollout callbacks around it) -> rollout callbacks may reshape scores ->
    group advantages -> mini-batch updates -> sync weights to the rollout engine

Optimisation is manual: a step may run several mini-batch updates, and only the last one goes
through Lightning's optimizer wrapper so that ``global_step`` advances once per RL step.

Several processes (``trainer=ddp``): each rank takes a contiguous shard of the step's prompts and
generates, grades and scores only those (a group never spans ranks); dynamic sampling counts kept
groups over all ranks; the loss of a mini-batch is normalised by its global token / sequence count
and the gradients are summed over ranks in one all-reduce per update, so a run on W ranks makes
the same updates as one process with the same global batch. DDP's own per-backward gradient sync
is switched off for this (ranks may run different numbers of micro-batches).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning as L
import torch

from medsrl.algo import (
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    keep_mask_by_group_spread,
    kl_estimate,
    masked_mean,
    sampling_mismatch,
    token_entropy,
    token_logprobs,
)
from medsrl.callbacks.protocol import StepRollouts, rollout_callbacks
from medsrl.config import (
    AlgorithmConfig,
    GraderConfig,
    LoggingConfig,
    OptimConfig,
    RolloutConfig,
    build,
    to_dict,
)
from medsrl.reward.grader import MathGrader
from medsrl.reward.overlong import overlong_penalty
from medsrl.rollout.base import PackedRollouts, RolloutBatch, SamplingParams, pack_rollouts
from medsrl.rollout.factory import BACKENDS, build_engine
from medsrl.utils.distributed import (
    all_gather_objects,
    all_reduce_grads,
    all_reduce_sum,
    is_distributed,
    rank_and_size,
    shard_bounds,
)
from medsrl.utils.sharding import full_weights, grad_norm, is_sharded, shard_policy

log = logging.getLogger(__name__)


class RLModule(L.LightningModule):
    """Policy + GRPO/DAPO loss. ``policy`` is any Hugging Face causal LM."""

    def __init__(
        self,
        policy: torch.nn.Module,
        tokenizer,
        algorithm: dict | AlgorithmConfig | None = None,
        rollout: dict | RolloutConfig | None = None,
        optim: dict | OptimConfig | None = None,
        grader: dict | GraderConfig | None = None,
        logging_cfg: dict | LoggingConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.algo = build(AlgorithmConfig, algorithm, "algorithm")
        self.rollout_cfg = build(RolloutConfig, rollout, "rollout")
        self.optim_cfg = build(OptimConfig, optim, "optim")
        self.grader_cfg = build(GraderConfig, grader, "grader")
        self.logging_cfg = build(LoggingConfig, logging_cfg, "logging")
        self.seed = seed
        self._check_settings()
        self.save_hyperparameters(
            {
                "algorithm": to_dict(self.algo),
                "rollout": to_dict(self.rollout_cfg),
                "optim": to_dict(self.optim_cfg),
                "grader": to_dict(self.grader_cfg),
                "seed": seed,
            }
        )
        self.ref_policy: torch.nn.Module | None = None
        self.engine = None
        self.grader: MathGrader | None = None
        self.last_rollouts: StepRollouts | None = None

    def _check_settings(self) -> None:
        ov = self.algo.overlong
        if ov.enabled and not 0 < ov.buffer_length < self.rollout_cfg.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong.buffer_length={ov.buffer_length} must be between 0 and "
                f"rollout.max_new_tokens={self.rollout_cfg.max_new_tokens}"
            )
        if self.rollout_cfg.backend not in BACKENDS:
            raise ValueError(
                f"rollout.backend={self.rollout_cfg.backend!r}; valid: {', '.join(BACKENDS)}"
            )

    # ------------------------------------------------------------------ setup

    def setup(self, stage: str) -> None:
        if self.algo.kl_coef > 0 and self.ref_policy is None:
            # A frozen copy of the starting policy; excluded from checkpoints (see state_dict).
            self.ref_policy = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if self.grader is None:
            self.grader = MathGrader(
                timeout_s=self.grader_cfg.timeout_s, num_workers=self.grader_cfg.num_workers
            )
        if self.engine is None:
            cfg = self.rollout_cfg
            self.engine = build_engine(cfg, self.policy, self.tokenizer, seed=self.seed)

    def configure_model(self) -> None:
        """Under ``trainer=fsdp``: shard the policy (one FSDP unit; see ``utils/sharding.py``)."""
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = self.trainer.strategy
        if isinstance(strategy, FSDPStrategy) and not is_sharded(self.policy):
            self.policy = shard_policy(self.policy, strategy)
            if self.ref_policy is not None:  # FSDP moves only what it wraps
                self.ref_policy.to(strategy.root_device)

    @contextmanager
    def full_policy(self):
        """The policy as a plain module with all its weights, for generation and scoring.

        Under FSDP the weights are gathered for the block, on every rank together; otherwise it
        is the policy itself.
        """
        with full_weights(self.policy) as policy:
            yield policy

    def on_train_start(self) -> None:
        # A resumed fit restores the weights after setup built the engine: serve those, not the base.
        with self.full_policy() as policy:
            self.engine.sync_weights(policy)
        ddp = self.trainer.strategy.model
        if is_distributed() and hasattr(ddp, "require_backward_grad_sync"):
            ddp.require_backward_grad_sync = False  # we all-reduce once per update (_update)

    def teardown(self, stage: str) -> None:
        if self.grader is not None and stage == "fit":
            self.grader.close()
            self.grader = None

    def state_dict(self, *args, **kwargs):
        """The policy only: the reference model is rebuilt from the policy at start."""
        sd = super().state_dict(*args, **kwargs)
        return {k: v for k, v in sd.items() if not k.startswith("ref_policy.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = {k for k in super().state_dict() if k.startswith("ref_policy.")}
        missing_ok = own if strict else set()
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        if strict:
            missing = [k for k in result.missing_keys if k not in missing_ok]
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    f"checkpoint does not match the policy: missing {missing[:5]}, "
                    f"unexpected {result.unexpected_keys[:5]}"
                )
        return result

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            params,
            lr=self.optim_cfg.lr,
            betas=self.optim_cfg.betas,
            eps=self.optim_cfg.eps,
            weight_decay=self.optim_cfg.weight_decay,
        )
        warmup = max(0, self.optim_cfg.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------- the step

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        step = self.global_step
        if batch.get("step", step) != step:
            log.warning("data step %s != trainer step %s", batch.get("step"), step)
        timer = _PhaseTimer()
        metrics: dict[str, float] = {}

        with timer("generate"):
            prompts, rollout = self._generate(batch["prompts"], step, round_=0)
        with timer("grade"):
            grades = self.grader.grade_batch(
                rollout.response_text, [prompts[i].answer for i in rollout.prompt_index]
            )
        if self.algo.dynamic_sampling.enabled:
            with timer("dynamic_sampling"):
                prompts, rollout, grades, ds_metrics = self._dynamic_sampling(
                    batch, prompts, rollout, grades, step, timer
                )
            metrics.update(ds_metrics)
        else:
            acc = torch.tensor([g.score for g in grades])
            metrics["zero_spread_group_frac"] = _zero_spread_frac(acc, rollout.prompt_index)

        if min(all_gather_objects(len(rollout))) == 0:
            # Nothing to learn from (on some rank): advance the step without touching the weights.
            self._skip_update(step, metrics, timer)
            return

        rollouts = self._make_step_rollouts(step, batch.get("stage"), prompts, rollout, grades)
        callbacks = rollout_callbacks(self.trainer)
        with timer("logprob"), self.full_policy() as policy:
            for cb in callbacks:
                cb.on_before_logprob_forward(self.trainer, self, rollouts)
            rollouts.old_logp, _ = self._logprobs(
                policy, rollouts.packed, with_entropy=False, rollouts=rollouts, callbacks=callbacks
            )
            for cb in callbacks:
                cb.on_after_logprob_forward(self.trainer, self, rollouts)
            if self.ref_policy is not None:
                rollouts.ref_logp, _ = self._logprobs(self.ref_policy, rollouts.packed, False)
        if rollouts.engine_logp is not None:
            gap = sampling_mismatch(rollouts.engine_logp, rollouts.old_logp, rollouts.packed.response_mask)
            metrics.update({f"engine/{k}": v for k, v in gap.items()})
        with timer("callbacks"):
            for cb in callbacks:
                cb.on_rollouts_scored(self.trainer, self, rollouts)

        advantages = group_advantages(
            rollouts.scores, rollouts.group_ids, norm_by_std=self.algo.norm_adv_by_std
        )
        with timer("update"):
            update_metrics = self._update(rollouts, advantages, step)
        with timer("sync"), self.full_policy() as policy:
            self.engine.sync_weights(policy)
        self.last_rollouts = rollouts

        metrics.update(update_metrics)
        metrics.update(_rollout_metrics(rollouts, self.grader))
        metrics.update(rollouts.metrics)
        metrics.update(timer.as_metrics())
        self._log_step(metrics, batch.get("stage"))

    # ----------------------------------------------------------- generation

    def _sampling(self, step: int, round_: int, n: int, temperature: float, top_p: float, logprobs=False):
        # Seeded by (seed, step, round): a resumed run samples exactly what an uninterrupted one would.
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=self.rollout_cfg.max_new_tokens,
            seed=(self.seed * 1_000_003 + step * 101 + round_) % (2**31),
            logprobs=logprobs,
        )

    def _generate(self, prompts, step: int, round_: int) -> tuple[list, RolloutBatch]:
        """Generate for this rank's contiguous shard of ``prompts`` (all of them in one process).

        The shard starting at prompt ``s`` is sampled with seed ``base + s``, which the engine
        continues per chunk, so the responses do not depend on the number of ranks.
        """
        cfg = self.rollout_cfg
        rank, size = rank_and_size()
        start, stop = shard_bounds(len(prompts), rank, size)
        params = self._sampling(step, round_, cfg.n, cfg.temperature, cfg.top_p, cfg.logprobs)
        params = dataclasses.replace(params, seed=params.seed + start)
        shard = list(prompts)[start:stop]
        with self.full_policy():
            return shard, self.engine.generate([p.text for p in shard], params)

    def _dynamic_sampling(self, batch, prompts, rollout, grades, step, timer):
        """DAPO: keep groups whose accuracy differs; generate extra rounds until the batch is full.

        The batch is the step's global prompt count; kept groups are counted over all ranks, and
        the surplus of the last round is cut in (round, rank, prompt) order, which is the order
        of one process holding every prompt.
        """
        target = len(batch["prompts"])
        kept_by_round: list[list[tuple[Any, RolloutBatch, list]]] = []
        first_zero_frac = None
        rounds = 0
        total = 0
        while True:
            acc = torch.tensor([g.score for g in grades])
            groups = torch.tensor(rollout.prompt_index, dtype=torch.long)
            keep = keep_mask_by_group_spread(acc, groups) if len(acc) else torch.zeros(0, dtype=torch.bool)
            if first_zero_frac is None:
                zero = _zero_spread_frac(acc, rollout.prompt_index) * len(prompts) if len(acc) else 0.0
                first_zero_frac = all_reduce_sum(zero) / max(all_reduce_sum(len(prompts)), 1)
            kept = []
            for g in sorted({int(g) for g in groups[keep].tolist()}):
                rows = [i for i, pi in enumerate(rollout.prompt_index) if pi == g]
                kept.append((prompts[g], rollout.select(rows), [grades[i] for i in rows]))
            kept_by_round.append(kept)
            total += all_reduce_sum(len(kept))
            if total >= target or rounds >= self.algo.dynamic_sampling.max_rounds:
                break
            rounds += 1
            extra = self.trainer.datamodule.extra_prompts(step, rounds, target)
            with timer("generate"):
                prompts, rollout = self._generate(extra, step, round_=rounds)
            with timer("grade"):
                grades = self.grader.grade_batch(
                    rollout.response_text, [prompts[i].answer for i in rollout.prompt_index]
                )
        take = _my_share(all_gather_objects([len(k) for k in kept_by_round]), rank_and_size()[0], target)
        chosen = [item for kept, n in zip(kept_by_round, take, strict=True) for item in kept[:n]]
        filled = min(int(total), target)
        if filled < target:
            log.info(
                "step %d: dynamic sampling filled %d/%d groups after %d extra rounds",
                step, filled, target, rounds,
            )
        merged = RolloutBatch.concat_groups([r for _, r, _ in chosen])
        metrics = {
            "zero_spread_group_frac": first_zero_frac,
            "dynamic_sampling/extra_rounds": float(rounds),
            "dynamic_sampling/kept_groups": float(filled),
            "dynamic_sampling/batch_fill": filled / max(target, 1),
        }
        return [p for p, _, _ in chosen], merged, [g for _, _, gs in chosen for g in gs], metrics

    def _make_step_rollouts(self, step, stage, prompts, rollout: RolloutBatch, grades) -> StepRollouts:
        packed = pack_rollouts(rollout.prompt_ids, rollout.response_ids, self.tokenizer.pad_token_id)
        acc = torch.tensor([g.score for g in grades], dtype=torch.float32)
        reward = acc.clone()
        ov = self.algo.overlong
        if ov.enabled:
            lengths = torch.tensor([len(r) for r in rollout.response_ids])
            reward = reward + overlong_penalty(
                lengths, self.rollout_cfg.max_new_tokens, ov.buffer_length, ov.penalty_factor
            )
        return StepRollouts(
            step=step,
            stage=stage,
            prompts=prompts,
            group_ids=torch.tensor(rollout.prompt_index, dtype=torch.long),
            response_ids=rollout.response_ids,
            response_text=rollout.response_text,
            finish_reason=rollout.finish_reason,
            grades=grades,
            packed=packed.to(self.device),
            acc=acc,
            reward=reward,
            scores=reward.clone(),
            engine_logp=_padded(rollout.response_logprobs, packed.response_length, self.device),
        )

    # ------------------------------------------------------------- forward

    def _forward(self, model, packed: PackedRollouts, rows: slice | torch.Tensor):
        """Logits of the response positions only: ``logits[:, t]`` predicts response token t."""
        resp_len = packed.response_mask.shape[1]
        out = model(
            input_ids=packed.input_ids[rows],
            attention_mask=packed.attention_mask[rows],
            position_ids=packed.position_ids[rows],
            use_cache=False,
            logits_to_keep=resp_len + 1,
        )
        return out.logits[:, :-1, :]

    def _logprobs(self, model, packed: PackedRollouts, with_entropy: bool, rollouts=None, callbacks=()):
        """No-grad log-probs of the response tokens, in micro-batches.

        With ``rollouts``, each micro-batch forward runs inside every callback's
        ``logprob_microbatch`` context (MEDS reads its features from this same forward).
        """
        B = packed.input_ids.shape[0]
        mb = self.algo.micro_batch_size
        logps, ents = [], []
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for start in range(0, B, mb):
                stop = min(start + mb, B)
                rows = slice(start, stop)
                with ExitStack() as stack:
                    if rollouts is not None:
                        for cb in callbacks:
                            stack.enter_context(cb.logprob_microbatch(self.trainer, self, rollouts, start, stop))
                    logits = self._forward(model, packed, rows)
                labels = packed.input_ids[rows, packed.prompt_length :]
                logps.append(token_logprobs(logits, labels))
                if with_entropy:
                    ents.append(token_entropy(logits))
        model.train(was_training)
        return torch.cat(logps), (torch.cat(ents) if with_entropy else None)

    # -------------------------------------------------------------- update

    def _update(self, rollouts: StepRollouts, advantages: torch.Tensor, step: int) -> dict[str, float]:
        """PPO epochs x mini-batches (whole groups) x micro-batches with gradient accumulation.

        Gradients are summed over ranks once per update (DDP: ``all_reduce_grads``). Under FSDP the
        backward passes themselves reduce-scatter (a mean over ranks, so the loss is scaled by the
        world size to make it a sum), which makes every backward a collective: ranks with fewer
        micro-batches run zero-weight ones to keep in step, and a non-finite loss is still
        back-propagated (the update is then dropped on every rank).
        """
        algo = self.algo
        opt = self.optimizers()
        sched = self.lr_schedulers()
        packed = rollouts.packed
        advantages = advantages.to(self.device)
        # Mini-batches are ranges of global group indices (this rank holds groups offset..);
        # every rank runs the same number of updates, possibly with no rows of its own.
        rank = rank_and_size()[0]
        counts = all_gather_objects(len(rollouts.prompts))
        offset, mine, num_groups = sum(counts[:rank]), counts[rank], sum(counts)
        per_update = algo.mini_batch_prompts or num_groups
        group_ids = rollouts.group_ids
        mini_batches = []
        for lo in range(0, num_groups, per_update):
            first, last = max(lo, offset), min(lo + per_update, offset + mine)
            mini_batches.append(torch.arange(first, max(first, last)) - offset)
        total_updates = algo.ppo_epochs * len(mini_batches)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        sharded = is_sharded(self.policy)
        world = rank_and_size()[1]
        mb_size = algo.micro_batch_size
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        nonfinite = 0
        updates_done = 0

        self.policy.train()
        for _epoch in range(algo.ppo_epochs):
            for mb_groups in mini_batches:
                rows = torch.nonzero(torch.isin(group_ids, mb_groups)).flatten()
                mask = packed.response_mask[rows]
                num_tokens = all_reduce_sum(float(mask.sum().item()))
                num_seqs = all_reduce_sum(float(len(rows)))
                opt.zero_grad(set_to_none=True)
                bad = False
                num_micro = -(-len(rows) // mb_size)
                if sharded:  # FSDP: every rank runs as many forward/backward passes as the busiest
                    num_micro = max(all_gather_objects(num_micro))
                for i in range(num_micro):
                    mrows = rows[i * mb_size : (i + 1) * mb_size].to(self.device)
                    weight = float(world) if sharded else 1.0
                    if len(mrows) == 0:  # a pass to keep in step: any row of ours, weight 0
                        mrows, weight = torch.zeros(1, dtype=torch.long, device=self.device), 0.0
                    loss, m = self._micro_loss(rollouts, advantages, mrows, num_tokens, num_seqs)
                    if weight and not torch.isfinite(loss):
                        bad = True
                        if not sharded:
                            break
                    self.manual_backward(loss * weight)
                    if weight:
                        for k, v in m.items():
                            sums[k] = sums.get(k, 0.0) + v * len(mrows)
                            counts[k] = counts.get(k, 0) + len(mrows)
                bad = all_reduce_sum(float(bad)) > 0
                if not bad and not sharded:
                    all_reduce_grads(params)
                norm = float("nan") if bad else grad_norm(params, sharded)
                if bad or not math.isfinite(norm):
                    nonfinite += 1
                    log.warning(
                        "step %d: non-finite %s in update %d/%d; update skipped, weights unchanged",
                        step, "loss" if bad else "gradient", updates_done + 1, total_updates,
                    )
                    opt.zero_grad(set_to_none=True)
                else:
                    if self.optim_cfg.grad_clip > 0:
                        torch.nn.utils.clip_grads_with_norm_(params, self.optim_cfg.grad_clip, torch.tensor(norm))
                    sums["grad_norm"] = sums.get("grad_norm", 0.0) + norm
                    counts["grad_norm"] = counts.get("grad_norm", 0) + 1
                updates_done += 1
                last = updates_done == total_updates
                if last:
                    opt.step()  # counts one global step; skips params without grads
                else:
                    self.trainer.strategy.optimizer_step(opt.optimizer, closure=_no_closure)
        sched.step()
        out = {k: sums[k] / counts[k] for k in sums}
        out["nonfinite_updates"] = float(nonfinite)
        out["lr"] = float(sched.get_last_lr()[0])
        return out

    def _micro_loss(self, rollouts, advantages, rows, num_tokens, num_seqs):
        algo = self.algo
        packed = rollouts.packed
        logits = self._forward(self.policy, packed, rows)
        labels = packed.input_ids[rows, packed.prompt_length :]
        logp = token_logprobs(logits, labels)
        mask = packed.response_mask[rows]
        old = rollouts.old_logp[rows]
        pl = clipped_surrogate(
            logp,
            old,
            advantages[rows],
            mask,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            dual_clip=algo.dual_clip,
        )
        agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=self.rollout_cfg.max_new_tokens)
        loss = aggregate_loss(pl.loss_mat, mask, algo.loss_agg_mode, **agg)
        metrics = {
            "pg_loss": float(loss.detach()),
            "clipfrac": float(pl.clipfrac),
            "clipfrac_low": float(pl.clipfrac_low),
            "clipfrac_high": float(pl.clipfrac_high),
            "dual_clipfrac": float(pl.dual_clipfrac),
            "ppo_kl": float(pl.approx_kl),
        }
        entropy = token_entropy(logits.detach()) if algo.entropy_coef == 0 else token_entropy(logits)
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * aggregate_loss(entropy, mask, algo.loss_agg_mode, **agg)
        if rollouts.ref_logp is not None:
            kl = kl_estimate(logp, rollouts.ref_logp[rows], algo.kl_kind)
            metrics["kl"] = float(masked_mean(kl.detach(), mask))
            loss = loss + algo.kl_coef * aggregate_loss(kl, mask, algo.loss_agg_mode, **agg)
        return loss, metrics

    def _skip_update(self, step: int, metrics: dict[str, float], timer) -> None:
        log.warning("step %d: no rollouts left to train on; step skipped", step)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        opt.step()
        self.lr_schedulers().step()
        metrics.update(timer.as_metrics())
        metrics["skipped"] = 1.0
        self._log_step(metrics, None)

    # ------------------------------------------------------------ logging

    def _log_step(self, metrics: dict[str, float], stage: str | None) -> None:
        if is_distributed():
            metrics = _mean_over_ranks(all_gather_objects(metrics))
        bar = {"reward", "acc"}
        for k, v in metrics.items():
            if v is None:
                continue
            self.log(f"train/{k}", float(v), on_step=True, on_epoch=False, prog_bar=k in bar, batch_size=1)
        if stage is not None:
            names = [s.name for s in getattr(self.trainer.datamodule, "stages", [])]
            idx = names.index(stage) if stage in names else -1
            self.log("train/stage", float(idx), on_step=True, on_epoch=False, batch_size=1)

    # --------------------------------------------------------------- export

    def export_policy(self, path) -> None:
        """Save the policy and tokenizer the Hugging Face way (``from_pretrained`` loads it).

        Every rank calls it (FSDP gathers the weights); rank 0 writes.
        """
        with self.full_policy() as policy:
            if rank_and_size()[0] == 0:
                policy.save_pretrained(path)
                self.tokenizer.save_pretrained(path)


def _no_closure() -> None:
    return None


class _PhaseTimer:
    """Wall time per phase of a step, summed when a phase runs more than once."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/step"] = time.perf_counter() - self.t0
        return out


def _my_share(counts: list[list[int]], rank: int, target: int) -> list[int]:
    """Per round, how many of this rank's kept groups make the batch: the first ``target`` kept
    groups in (round, rank) order. ``counts[q][r]``: groups rank ``q`` kept in round ``r``."""
    budget = target
    mine = []
    for r in range(len(counts[0])):
        for q, per_round in enumerate(counts):
            n = min(per_round[r], max(budget, 0))
            budget -= n
            if q == rank:
                mine.append(n)
    return mine


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the ranks that report it (shards are near-equal in size)."""
    keys = dict.fromkeys(k for m in per_rank for k in m)
    out = {}
    for k in keys:
        vals = [m[k] for m in per_rank if m.get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def _zero_spread_frac(acc: torch.Tensor, prompt_index: list[int]) -> float:
    groups = torch.tensor(prompt_index)
    if len(groups) == 0:
        return 0.0
    keep = keep_mask_by_group_spread(acc, groups)
    num_groups = len(set(prompt_index))
    kept = len({int(g) for g in groups[keep].tolist()})
    return 1.0 - kept / num_groups


def _padded(rows: list[list[float]] | None, width: int, device) -> torch.Tensor | None:
    """Ragged per-token values as ``[B, width]``, zero-padded (``None`` stays ``None``)."""
    if rows is None:
        return None
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out.to(device)


def _rollout_metrics(r: StepRollouts, grader: MathGrader) -> dict[str, float]:
    lengths = r.packed.response_mask.sum(-1).float()
    truncated = torch.tensor([f == "length" for f in r.finish_reason], dtype=torch.float32)
    no_box = torch.tensor([not g.has_box for g in r.grades], dtype=torch.float32)
    out = {
        "reward": float(r.reward.mean()),
        "acc": float(r.acc.mean()),
        "score": float(r.scores.mean()),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncation_rate": float(truncated.mean()),
        "no_box_rate": float(no_box.mean()),
        "num_responses": float(len(r)),
        "num_groups": float(len(r.prompts)),
        "grader/timeouts_step": float(sum(g.timed_out for g in r.grades)),
        "grader/errors_step": float(sum(g.error is not None for g in r.grades)),
        "grader/timeouts_total": float(grader.stats.get("timeouts", 0)),
    }
    return out
