"""FSDP for the policy: one unit per decoder layer, gathered a unit at a time.

Every forward of the policy goes through the FSDP wrapper (the scoring pass, the MEDS features,
validation's feature forward, the update), each a collective: ranks agree on the number of
passes (:func:`agreed_passes`) and a rank with fewer rows joins the others' with a one-token
:func:`idle_forward`. The weights go to the rollout engine a unit at a time
(:func:`streamed_weights`). Only HF generation and the export gather the whole policy
(:func:`full_weights`). Layout and precision: docs/ARCHITECTURE.md and docs/GPU.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
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

from medsrl.utils.distributed import all_gather_objects, all_reduce_sum


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDP)


class PolicyFSDPPrecision(FSDPPrecision):
    """Lightning's FSDP precision with the autocast its AMP plugin uses: on the strategy's device
    type (Lightning's is CUDA only, so a CPU run computed without autocast) and without the
    weight-cast cache (Lightning's keeps it on, so every fp32 weight a forward in
    ``training_step`` cast to bf16 stayed alive as a bf16 copy to the end of the step)."""

    def __init__(self, precision: str, device_type: Callable[[], str]) -> None:
        super().__init__(precision)
        self._device_type = device_type

    def forward_context(self):
        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)
        if low is None:
            return super().forward_context()
        return torch.autocast(self._device_type(), dtype=low, cache_enabled=False)


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
    def precision_plugin(self) -> FSDPPrecision:
        return FSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Lightning's own FSDP precision plugin becomes :class:`PolicyFSDPPrecision`."""
        if type(plugin) is FSDPPrecision:
            plugin = PolicyFSDPPrecision(plugin.precision, lambda: self.root_device.type)
        FSDPStrategy.precision_plugin.fset(self, plugin)

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


def agreed_passes(count: int, sharded: bool) -> int:
    """How many forwards every rank runs when this one has ``count``: under FSDP each forward is
    a collective (its units' all-gathers), so every rank runs as many as the busiest one."""
    return max(all_gather_objects(count)) if sharded else count


@torch.no_grad()
def idle_forward(model: nn.Module) -> None:
    """A one-token no-grad forward through the FSDP wrapper: this rank's part of a pass it has
    no rows for (the other ranks' all-gathers wait for it)."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)


def idle_passes(model: nn.Module) -> None:
    """This rank has no rows for a forward the others run (under FSDP): join all their passes."""
    for _ in range(agreed_passes(0, sharded=True)):
        idle_forward(model)


def streamed_weights(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The state a plain model of the policy holds (a LoRA policy's merged, under the base model's
    names: ``models/lora.py`` ``merged_weights``), one tensor at a time, for an engine's layerwise
    reload. Under FSDP one unit is gathered at a time (the root's own weights: embeddings, final
    norm, LM head; then each decoder layer with its adapters), and each tensor is a fresh copy in
    ``dtype`` (the engine may hold it until its layer is complete, past the unit's release). Every
    rank must run it to the end together: each unit's gather is a collective."""
    from medsrl.models.lora import merged_weights, unwrap_peft

    if not is_sharded(module):
        yield from merged_weights(module, dtype)
        return
    plain = unwrap_peft(module.module)
    # the root first: its gather also initialises FSDP's root state, which a nested unit's would
    # claim for itself
    with FSDP.summon_full_params(module, recurse=False, writeback=False):
        yield from merged_weights(plain, dtype, copy=True, skip=lambda m: isinstance(m, FSDP))
    for prefix, unit in _top_units(plain):
        with FSDP.summon_full_params(unit, recurse=True, writeback=False):
            for name, t in merged_weights(unit, dtype, copy=True):
                yield f"{prefix}.{_clean(name)}", t


def _top_units(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, FSDP]]:
    """The FSDP units in ``module``'s tree not nested in another one, with their names."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, FSDP):
            yield path, child
        else:
            yield from _top_units(child, path + ".")


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


@contextlib.contextmanager
def full_weights(module: nn.Module) -> Iterator[nn.Module]:
    """The plain module with all its weights for the block, for reading (changes are discarded):
    gathered on every rank when FSDP-wrapped (a collective: all ranks enter together). For HF
    generation and the export; everything else goes through the wrapper."""
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
