"""FSDP for the policy: sharded per decoder layer for the update, whole for generation and scoring.

The update's passes (the same number on every rank) go through the FSDP wrapper; rank-local work
of different lengths (generation, scoring, MEDS capture, export) runs inside :func:`full_weights`,
so nothing in it is a collective. Layout and precision: docs/ARCHITECTURE.md and docs/GPU.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

from medsrl.utils.distributed import all_reduce_sum


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDP)


class PolicyFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` for a module that shards its own policy (``shard_policy``), on
    the CPU too (gloo; Lightning's own class refuses it). There the full checkpoint is gathered
    without ``offload_to_cpu`` (with it, torch 2.13's FSDP segfaults cloning the weights)."""

    strategy_name = "medsrl_fsdp"

    def __init__(self, *args, **kwargs) -> None:
        if not kwargs.get("use_orig_params", False):
            raise ValueError(
                "trainer=fsdp needs strategy.use_orig_params=true: the optimiser and the MEDS "
                "capture address the policy's own parameters (configs/trainer/fsdp.yaml sets it)"
            )
        if kwargs.get("auto_wrap_policy") is not None:
            raise ValueError(
                "trainer=fsdp wraps each decoder layer of the policy itself (the model's "
                "_no_split_modules; see medsrl.models.sharding): remove strategy.auto_wrap_policy"
            )
        super().__init__(*args, **kwargs)

    @property
    def mixed_precision_config(self):
        """Mixed precision over fp32 shards: bf16 (fp16) compute, fp32 gradient reduction and
        buffers. Lightning's own for ``bf16-mixed`` also reduces gradients in bf16 and casts the
        RoPE buffers to bf16; other precisions (``32-true``) keep Lightning's."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(self.precision_plugin.precision))
        if low is None:
            return super().mixed_precision_config
        return MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

    def _full_on_cpu(self) -> bool:
        return self._state_dict_type == "full" and self.root_device.type == "cpu"

    def _full_context_without_offload(self):
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
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        with self._full_context_without_offload():
            state = FSDP.optim_state_dict(self.model, optimizer)
        if self.global_rank == 0:  # the plain per-parameter-id layout, as Lightning saves it
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state


def layer_classes(policy: nn.Module) -> set[type[nn.Module]]:
    """The classes of the model's ``_no_split_modules`` (its decoder layers) found among its
    modules; a LoRA policy's are its base model's (the adapters shard with the layers)."""
    from medsrl.models.lora import unwrap_peft

    names = set(getattr(unwrap_peft(policy), "_no_split_modules", None) or [])
    classes = {type(m) for m in policy.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"trainer=fsdp: {type(policy).__name__} names no decoder layer class in "
            f"_no_split_modules ({sorted(names)}): cannot shard it per layer"
        )
    return classes


def shard_policy(policy: nn.Module, strategy: FSDPStrategy) -> nn.Module:
    """``policy`` with one FSDP unit per decoder layer and a root unit for the rest, as ``strategy``
    says; LoRA adapters are units of their own, so no layer's unit keeps a flat gradient."""
    from medsrl.models.lora import is_adapter_leaf, is_lora

    classes = tuple(layer_classes(policy))
    wrap = ModuleWrapPolicy(classes)
    if is_lora(policy):
        wrap = CustomPolicy(lambda m: isinstance(m, classes) or is_adapter_leaf(m))
    return FSDP(
        policy,
        auto_wrap_policy=wrap,
        sharding_strategy=strategy.sharding_strategy,
        cpu_offload=strategy.cpu_offload,
        mixed_precision=strategy.mixed_precision_config,
        device_id=strategy.root_device,
        use_orig_params=True,
    )


@contextlib.contextmanager
def full_weights(module: nn.Module) -> Iterator[nn.Module]:
    """The plain module with all its weights for the block, for reading (changes are discarded):
    gathered on every rank when FSDP-wrapped (a collective: all ranks enter together)."""
    if not is_sharded(module):
        yield module
        return
    with FSDP.summon_full_params(module, writeback=False), torch.no_grad(), \
            _without_inner_units(module.module) as plain:
        yield plain


@contextlib.contextmanager
def _without_inner_units(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` with each nested FSDP unit replaced by the module it wraps, for the block: a
    unit's own forward would cast its inputs to the mixed-precision dtype and free the weights."""
    swapped = []
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, FSDP):
                parent._modules[name] = child.module
                swapped.append((parent, name, child))
    try:
        yield module
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def grad_norm(params: list[nn.Parameter], sharded: bool) -> float:
    """The global L2 norm of the gradients; with sharded gradients the squares are summed over
    ranks first (each rank holds a disjoint slice)."""
    norms = [p.grad.detach().float().norm(2) for p in params if p.grad is not None]
    sq = float(torch.stack(norms).square().sum()) if norms else 0.0
    return (all_reduce_sum(sq) if sharded else sq) ** 0.5
