"""The LightningModule: Lightning glue around one RL step (``docs/ARCHITECTURE.md`` draws one). The
math is in ``medsrl.algo``, the phases in ``medsrl.step``, the training methods in ``medsrl.plugins``.
Under ddp / fsdp each rank generates, grades and scores a contiguous shard of the step's prompts.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning as L
import torch

from medsrl.algo import AdvantageInputs, compute_advantages, sampling_mismatch
from medsrl.algo.engine_correction import check_engine_correction
from medsrl.algo.policy_loss import policy_loss_reducers
from medsrl.algo.settings import AlgorithmConfig
from medsrl.models import lora
from medsrl.models.sharding import (
    PolicyFSDPStrategy,
    export_policy,
    full_weights,
    is_sharded,
    replicate_from_rank0,
    shard_policy,
)
from medsrl.plugins import Plugin, PluginHost, StepContext
from medsrl.reward.grader import MathGrader
from medsrl.reward.settings import GraderConfig
from medsrl.rollout.base import SamplingParams, sync_engine
from medsrl.rollout.factory import build_engine
from medsrl.rollout.settings import RolloutConfig
from medsrl.step.balance import balance_groups
from medsrl.step.metrics import (
    PhaseTimer,
    PromptVisits,
    mean_over_ranks,
    rollout_metrics,
    shaping_metrics,
    zero_spread_group_frac,
)
from medsrl.step.rollouts import Group, StepRollouts, split_groups
from medsrl.step.scoring import padding_metrics, scoring_forward_needed, scoring_pass
from medsrl.step.settings import OptimConfig
from medsrl.step.update import UpdateConfig, policy_update
from medsrl.utils.distributed import all_gather_objects, all_reduce_sum, is_distributed, rank_and_size, shard_bounds
from medsrl.utils.guard import NONFINITE_SAMPLING, RunawayError, RunawayGuard, param_norm

log = logging.getLogger(__name__)


class RLModule(L.LightningModule):
    """Policy + RL loss. ``policy`` is any Hugging Face causal LM; ``plugins`` run in order."""

    def __init__(self, policy: torch.nn.Module, tokenizer, algorithm: AlgorithmConfig | None = None,
                 rollout: RolloutConfig | None = None, optim: OptimConfig | None = None,
                 grader: GraderConfig | None = None, plugins: list[Plugin] | None = None, seed: int = 0,
                 merge_on_export: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.tokenizer = tokenizer
        self.algorithm = algorithm or AlgorithmConfig()
        self.rollout_cfg = rollout or RolloutConfig()
        self.optim_cfg = optim or OptimConfig()
        self.grader_cfg = grader or GraderConfig()
        self.plugins = list(plugins or [])
        self.host = PluginHost(self.plugins)
        self.reducers = _scoring_reducers(self.host, self.algorithm)
        self.seed = seed
        self.lora = lora.is_lora(policy)
        self.merge_on_export = merge_on_export
        r = self.rollout_cfg
        self.update_cfg = UpdateConfig(self.algorithm, self.optim_cfg.grad_clip, r.max_new_tokens)
        check_engine_correction(self.algorithm.engine_is_cap, r.logprobs, r.temperature, r.top_p)
        self.save_hyperparameters({
            "algorithm": self.algorithm.model_dump(exclude={"plugins"}), "plugins": [p.name for p in self.plugins],
            "rollout": self.rollout_cfg.model_dump(), "optim": self.optim_cfg.model_dump(),
            "grader": self.grader_cfg.model_dump(), "seed": seed,
        })
        self.ref_policy: torch.nn.Module | None = None
        self.engine = None
        self.grader: MathGrader | None = None
        self.last_rollouts: StepRollouts | None = None
        self.guard: RunawayGuard | None = None  # the runaway guard, built at each fit's start
        # how often each prompt key was sampled: per-prompt methods act only on prompts that come back
        self.prompt_visits = PromptVisits()

    def configure_callbacks(self) -> list[Plugin]:
        """Plug-ins are Lightning callbacks too: setup, teardown and checkpoint state."""
        return self.plugins

    def setup(self, stage: str) -> None:
        if self.algorithm.kl_coef > 0 and self.ref_policy is None and not self.lora:
            # a frozen copy, not checkpointed; with LoRA the reference is the policy, adapters off
            self.ref_policy = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if self.grader is None:
            per_node = self.trainer.num_devices if self._trainer is not None else 1
            self.grader = self.grader_cfg.grader(self.grader_cfg.workers(per_node))
        if self.engine is None:
            self.engine = build_engine(self.rollout_cfg, self.policy, self.tokenizer, seed=self.seed)

    def configure_model(self) -> None:
        """Under ``trainer=fsdp``: shard the policy (``models/sharding.py``)."""
        strategy = self.trainer.strategy
        if isinstance(strategy, PolicyFSDPStrategy) and not is_sharded(self.policy):
            self.policy = shard_policy(self.policy, strategy)
            if self.ref_policy is not None:  # a whole copy on every rank, rank 0's on the others
                self.ref_policy = replicate_from_rank0(self.ref_policy, strategy.root_device)

    def sync_engine(self, *, stale_only: bool = False) -> None:
        """``rollout.base.sync_engine`` of this module's engine and policy (every rank together)."""
        sync_engine(self.engine, self.policy, stale_only=stale_only)

    @contextmanager
    def policy_for_generation(self) -> Iterator[None]:
        """For the block, an HF engine generates with the full (gathered, LoRA-merged) weights: no
        collective per token, no adapter matmuls. vLLM holds its own copy: nothing to do."""
        if not self.engine.uses_policy_weights:
            yield
            return
        with full_weights(self.policy) as full:
            self.engine.sync_weights(full)
            try:
                yield
            finally:
                self.engine.sync_weights(self.policy)

    def on_train_start(self) -> None:
        o, params = self.optim_cfg, [p for p in self.policy.parameters() if p.requires_grad]
        self.guard = RunawayGuard(float(o.max_param_norm_growth), param_norm(params, is_sharded(self.policy)),
                                  o.optimizer.lr, str(self.trainer.precision))
        # A resumed fit restores the weights after setup built the engine: serve those, not the base.
        self.sync_engine()
        ddp = self.trainer.strategy.model
        if is_distributed() and hasattr(ddp, "require_backward_grad_sync"):
            ddp.require_backward_grad_sync = False  # gradients are summed once per update

    def teardown(self, stage: str) -> None:
        if self.grader is not None and stage == "fit":
            self.grader.close()
            self.grader = None

    def state_dict(self, *args, **kwargs):
        """The policy only (with LoRA its adapters only): the reference and a frozen base are rebuilt."""
        sd = super().state_dict(*args, **kwargs)
        return lora.checkpoint_state({k: v for k, v in sd.items() if not k.startswith("ref_policy.")}, self.lora)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        saved = self.state_dict()
        own = {k for k in super().state_dict() if k not in saved}  # the reference, a LoRA base
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        if strict:
            missing = [k for k in result.missing_keys if k not in own]
            if missing or result.unexpected_keys:
                raise RuntimeError(lora.mismatch_message(missing, result.unexpected_keys, self.lora))
        return result

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.prompt_visits.load_state_dict(checkpoint.get("prompt_visits", {}))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["prompt_visits"] = self.prompt_visits.state_dict()

    def configure_optimizers(self):
        """``optim.optimizer`` over the trained parameters, ``optim.scheduler`` stepped per RL step."""
        opt, sched = self.optim_cfg.built([p for p in self.policy.parameters() if p.requires_grad])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        step = self.global_step
        if batch.get("step", step) != step:
            log.warning("data step %s != trainer step %s", batch.get("step"), step)
        timer = PhaseTimer()
        self.prompt_visits.begin_step()
        ctx = StepContext.for_trainer(self.trainer, step, batch.get("stage"), timer, len(batch["prompts"]))
        prompts = self.host.add_prompts(batch["prompts"], ctx)
        ctx.num_prompts = len(prompts)

        sample = partial(self._sample, step, timer)  # (prompts, round) -> this rank's groups
        groups = sample(prompts, 0)
        ctx.metrics["zero_spread_group_frac"] = zero_spread_group_frac(groups)
        groups = self.host.fill_batch(groups, sample, self.trainer.datamodule, ctx)
        self.engine.release()  # sampling is over: the engine's memory goes to scoring and the update
        groups, balance = balance_groups(groups, self.algorithm.mini_batch_prompts)  # ranks: like tokens
        ctx.metrics.update(balance)
        stepper = _LightningStepper(self)
        if min(all_gather_objects(len(groups))) == 0:
            # Nothing to learn from (on some rank): advance the step without touching the weights.
            log.warning("step %d: no rollouts left to train on; step skipped", step)
            stepper.step(last=True)  # no gradients (freed after every optimiser step): no change
            stepper.end_step()
            ctx.metrics.update(timer.as_metrics(), skipped=1.0)
            return self._log_step(ctx.metrics, None)

        rollouts = StepRollouts.from_groups(groups, step, ctx.stage, self.tokenizer.pad_token_id, self.device)
        packed = rollouts.packed
        budget = dict(micro_batch_size=self.algorithm.micro_batch_size,
                      max_tokens=self.algorithm.max_tokens_per_microbatch)
        ctx.metrics.update(padding_metrics(packed, **budget))
        policy = self.policy  # under FSDP its wrapper, as in the update: the same log-probs
        with timer("logprob"):
            if self.scoring_forward_needed:
                ctx.scoring_policy = policy
                self.host.before_scoring(rollouts, ctx)
                rollouts.old_logp, rollouts.token_stats = scoring_pass(
                    policy, packed, **budget, reducers=self.reducers,
                    microbatch_context=self.host.microbatch_context(rollouts),
                )
                self.host.after_scoring(rollouts, ctx)
                ctx.scoring_policy = None
            if self.algorithm.kl_coef > 0:
                with lora.reference_policy(policy, self.ref_policy) as ref:
                    rollouts.ref_logp, _ = scoring_pass(ref, packed, **budget)
        if rollouts.engine_logp is not None:
            gap = sampling_mismatch(rollouts.engine_logp, rollouts.old_logp, rollouts.packed.response_mask)
            ctx.metrics.update({f"engine/{k}": v for k, v in gap.items()})
        with timer("shaping"):
            self.host.shape_rewards(rollouts, ctx)
            self.host.commit(rollouts, ctx)
            inputs = AdvantageInputs(
                rollouts.scores, rollouts.group_ids, rollouts.terms, rollouts.packed.response_mask,
                reduce_sum=all_reduce_sum if is_distributed() else None,
            )
            advantages = compute_advantages(self.algorithm.advantage, inputs, **self.algorithm.advantage_options)
            advantages = self.host.shape_advantages(rollouts, advantages, ctx)
            ctx.metrics.update(shaping_metrics(self.algorithm, inputs, rollouts, advantages))
        with timer("update"):
            ctx.metrics.update(policy_update(self.policy, stepper, rollouts, advantages, self.update_cfg, self.guard))
        with timer("sync"):
            self.sync_engine()
        self.last_rollouts = rollouts
        ctx.metrics.update(rollout_metrics(rollouts, self.grader.stats))
        ctx.metrics.update(self.prompt_visits.metrics())
        ctx.metrics.update(timer.as_metrics())
        self._log_step(ctx.metrics, ctx.stage)

    @property
    def scoring_forward_needed(self) -> bool:
        """Whether a step runs the no-grad scoring forward (``step/scoring.py``)."""
        return scoring_forward_needed(self.algorithm, self.plugins, self.reducers, self.rollout_cfg.logprobs)

    def _sample(self, step: int, timer: PhaseTimer, prompts: list, round_: int) -> list[Group]:
        """Generate and grade this rank's shard of ``prompts``, seeded by (seed, step, round) and the
        shard's first prompt: a resumed run, or one on other ranks, samples what one process would."""
        cfg = self.rollout_cfg
        self.prompt_visits.add(p.key for p in prompts)
        start, stop = shard_bounds(len(prompts), *rank_and_size())
        seed = (self.seed * 1_000_003 + step * 101 + round_) % (2**31) + start
        params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, seed=seed, logprobs=cfg.logprobs)
        shard = list(prompts)[start:stop]
        with timer("sync"):
            self.sync_engine(stale_only=True)
        with timer("generate"), self.policy_for_generation():
            try:
                rollout = self.engine.generate([p.text for p in shard], params)
            except RunawayError as e:  # inf/nan sampling probabilities: say at which step
                raise self.guard.error(step, NONFINITE_SAMPLING) from e
        with timer("grade"):
            grades = self.grader.grade_batch(rollout.response_text, [shard[i].answer for i in rollout.prompt_index])
        return split_groups(shard, rollout, grades, origin=(round_, start))

    def _log_step(self, metrics: dict[str, float], stage: str | None) -> None:
        if is_distributed():
            metrics = mean_over_ranks(all_gather_objects(metrics))
        for k, v in metrics.items():
            if v is not None:
                self.log(f"train/{k}", float(v), on_step=True, on_epoch=False,
                         prog_bar=k in ("reward", "acc"), batch_size=1)
        if stage is not None:
            names = [s.name for s in getattr(self.trainer.datamodule, "stages", [])]
            idx = names.index(stage) if stage in names else -1
            self.log("train/stage", float(idx), on_step=True, on_epoch=False, batch_size=1)

    def export_policy(self, path, dtype: torch.dtype | None = None) -> None:
        """The policy and tokenizer the Hugging Face way (every rank calls; rank 0 writes)."""
        export_policy(self.policy, self.tokenizer, path, dtype, merge_on_export=self.merge_on_export)


class _LightningStepper:
    """``policy_update``'s optimiser calls; only a step's last advances Lightning's ``global_step``."""

    def __init__(self, module: RLModule) -> None:
        self.module, self.opt, self.sched = module, module.optimizers(), module.lr_schedulers()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.module.manual_backward(loss)

    def step(self, last: bool) -> None:
        if last:
            self.opt.step()  # counts one global step
        else:
            self.module.trainer.strategy.optimizer_step(self.opt.optimizer, closure=lambda: None)

    def end_step(self) -> float:
        self.sched.step()
        return float(self.sched.get_last_lr()[0])


def _scoring_reducers(host: PluginHost, algo: AlgorithmConfig) -> dict:
    """The per-token stats the scoring forward computes: the plug-ins' and the policy loss's."""
    own = policy_loss_reducers(algo.policy_loss, algo.policy_loss_options)
    both = sorted(set(own) & set(host.reducers))
    if both:
        raise ValueError(f"token stats {both} are asked for by algorithm.policy_loss={algo.policy_loss!r} "
                         "and a plug-in")
    return {**host.reducers, **own}
