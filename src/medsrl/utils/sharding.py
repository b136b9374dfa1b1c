"""FSDP for the policy: sharded for the update, whole for generation and scoring.

Lightning's ``FSDPStrategy`` would wrap the whole LightningModule and expect every forward to go
through it. An RL step has two kinds of forward:

* the update's forward/backward passes: these go through the FSDP wrapper (weights gathered per
  forward, gradients reduce-scattered, AdamW states sharded). They are collectives, so every rank
  runs the same number of them (``RLModule._update`` pads with zero-weight micro-batches);
* generation, the no-grad scoring forward, MEDS capture, weight export: rank-local work of
  different lengths on each rank. :func:`full_weights` gathers the weights once for the block
  (``summon_full_params``) and hands out the plain module, so nothing inside is a collective.

So the policy is wrapped here, in ``RLModule.configure_model`` (Lightning then leaves it as it is),
as one FSDP unit with ``use_orig_params=True``: a nested unit would re-shard itself after each
forward inside the gathered block. Peak weight memory is one whole copy per rank (as generation
needs anyway); gradients and optimiser states, the larger part, are sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


class PolicyFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` for a module that shards its own policy (``shard_policy``,
    called from ``RLModule.configure_model``; Lightning then wraps nothing more).

    It checks the two settings that wrapping needs at construction, and it also runs on the CPU
    (gloo): Lightning's own class refuses ``accelerator=cpu``, although torch's FSDP runs there
    with ``device_id=cpu``. That is what ``tests/test_distributed.py`` runs. On the CPU the full
    checkpoint is gathered without ``offload_to_cpu`` (already there; with it, torch 2.13's FSDP
    crashes with a segmentation fault while cloning the gathered weights).
    """

    strategy_name = "medsrl_fsdp"

    def __init__(self, *args, **kwargs) -> None:
        if not kwargs.get("use_orig_params", False):
            raise ValueError(
                "trainer=fsdp needs strategy.use_orig_params=true: the optimiser and the MEDS "
                "capture address the policy's own parameters (configs/trainer/fsdp.yaml sets it)"
            )
        if kwargs.get("auto_wrap_policy") is not None:
            raise ValueError(
                "trainer=fsdp wraps the policy as one FSDP unit (see medsrl.utils.sharding); "
                "remove strategy.auto_wrap_policy"
            )
        super().__init__(*args, **kwargs)

    def _full_on_cpu(self) -> bool:
        return self._state_dict_type == "full" and self.root_device.type == "cpu"

    def _full_context_without_offload(self):
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._full_on_cpu():
            return super().lightning_module_state_dict()
        with self._full_context_without_offload():
            return self.model.state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self._full_on_cpu():
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        with self._full_context_without_offload():
            state = FSDP.optim_state_dict(self.model, optimizer)
        if self.global_rank == 0:  # the plain per-parameter-id layout, as Lightning saves it
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state


def shard_policy(policy: nn.Module, strategy: FSDPStrategy) -> nn.Module:
    """``policy`` as one FSDP unit with the sharding, precision and offload of ``strategy``, on
    its root device."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(
        policy,
        sharding_strategy=strategy.sharding_strategy,
        cpu_offload=strategy.cpu_offload,
        mixed_precision=strategy.mixed_precision_config,
        device_id=strategy.root_device,
        use_orig_params=True,
    )


@contextlib.contextmanager
def full_weights(module: nn.Module) -> Iterator[nn.Module]:
    """The plain module with all its weights for the block: gathered on every rank when
    ``module`` is FSDP-wrapped (a collective: all ranks enter together), itself otherwise.

    Changes made inside are discarded (``writeback=False``): the block is for reading.
    """
    if not is_sharded(module):
        yield module
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(module, writeback=False), torch.no_grad():
        yield module.module


def grad_norm(params: list[nn.Parameter], sharded: bool) -> float:
    """The global L2 norm of the gradients; with sharded gradients the squares are summed over
    ranks first (each rank holds a disjoint slice)."""
    from medsrl.utils.distributed import all_reduce_sum

    norms = [p.grad.detach().float().norm(2) for p in params if p.grad is not None]
    sq = float(torch.stack(norms).square().sum()) if norms else 0.0
    if sharded:
        sq = all_reduce_sum(sq)
    return sq**0.5
