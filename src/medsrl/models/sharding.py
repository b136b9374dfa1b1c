"""FSDP2 for the policy: each parameter a DTensor sharded over the ranks, one unit per decoder layer.

Every forward of the policy is a collective: ranks agree on the number of passes
(:func:`agreed_passes`) and a rank with fewer rows joins with a one-token :func:`idle_forward`. The
weights leave the shards one parameter at a time, in the receiver's dtype (:func:`streamed_weights`).
Only rank 0 loads the weights; the others build on ``meta`` and receive their shards. Layout and
precision: docs/ARCHITECTURE.md and docs/GPU.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from medsrl.utils.distributed import all_gather_objects, all_reduce_sum, local

STATE_DICT_TYPES = ("sharded", "full")


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def whole(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor in ``dtype``: a DTensor's shards cast first, so the gather (a collective)
    moves ``dtype``'s bytes."""
    t = t if dtype is None else t.to(dtype)
    return t.full_tensor() if isinstance(t, DTensor) else t


class PolicyFSDPStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as plain FSDP2 over every rank, on the CPU too (gloo).
    ``sharded`` checkpoints are re-sharded on load (a run resumes on another number of ranks);
    ``full`` gathers the policy and its AdamW states on rank 0 into one file in the plain layout."""

    strategy_name = "medsrl_fsdp"

    def __init__(self, state_dict_type: str = "sharded", reshard_after_forward: bool = True,
                 cpu_offload: bool = False, **kwargs: Any) -> None:
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"trainer.strategy.state_dict_type={state_dict_type!r}: one of {STATE_DICT_TYPES}")
        for old in ("use_orig_params", "sharding_strategy", "auto_wrap_policy"):
            if old in kwargs:
                raise ValueError(
                    f"trainer.strategy.{old} was a setting of FSDP1; trainer=fsdp is FSDP2 now, which needs none "
                    "(sharding_strategy=SHARD_GRAD_OP is reshard_after_forward=false; configs/trainer/fsdp.yaml)")
        super().__init__(tensor_parallel_size=1, save_distributed_checkpoint=state_dict_type == "sharded", **kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank shards the policy
        super().setup_environment()

    @property
    def shard_mesh(self):
        return self.device_mesh["data_parallel"]

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """bf16 (fp16) compute over the fp32 shards, gradients reduced in fp32."""
        low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(self.precision_plugin.precision))
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)

    @property
    def offload_policy(self) -> OffloadPolicy:
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """A full state in the plain layout, without FSDP1's deprecated re-keying."""
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)
        return plain_optimizer_layout(state) if self.global_rank == 0 else state

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A full checkpoint is read here, rank 0's tensors broadcast one at a time into the shards
        (Lightning re-keys the optimizer states with FSDP1's deprecated API)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                   strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            set_optimizer_state_dict(self.model, optimizer, named_optimizer_layout(state, self.model), options=options)
        return checkpoint


def plain_optimizer_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state in the layout of a plain ``optimizer.state_dict()`` (by position)."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def named_optimizer_layout(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """:func:`plain_optimizer_layout` reversed (the trained parameters in ``configure_optimizers``' order)."""
    if not state["state"] or not isinstance(next(iter(state["state"])), int):
        return dict(state)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def layer_classes(policy: nn.Module) -> set[type[nn.Module]]:
    """The decoder layer classes (``_no_split_modules``; a LoRA policy's base model's)."""
    from medsrl.models.lora import unwrap_peft

    names = set(getattr(unwrap_peft(policy), "_no_split_modules", None) or [])
    # by the class's own name or, once sharded (FSDP2 subclasses it: FSDPQwen2DecoderLayer), its base's
    classes = {c for m in policy.modules() for c in type(m).__mro__[:2] if c.__name__ in names}
    if not classes:
        raise ValueError(f"trainer=fsdp: {type(policy).__name__} names no decoder layer class in "
                         f"_no_split_modules ({sorted(names)}): cannot shard it per layer")
    return classes


def shard_policy(policy: nn.Module, strategy: PolicyFSDPStrategy) -> nn.Module:
    """``policy`` sharded in place: a unit per decoder layer (with its LoRA adapters), then the root."""
    source = _rank0_source(policy)
    classes = tuple(layer_classes(policy))
    options = dict(mesh=strategy.shard_mesh, mp_policy=strategy.mixed_precision_policy,
                   offload_policy=strategy.offload_policy, reshard_after_forward=strategy.reshard_after_forward)
    for module in list(policy.modules()):
        if isinstance(module, classes):
            fully_shard(module, **options)
    fully_shard(policy, **options)
    if source is not None:
        materialize_from_rank0(policy, source, strategy.root_device)
    return policy


def _rank0_source(policy: nn.Module) -> dict[str, torch.Tensor] | None:
    """Rank 0's whole state when the other ranks built on ``meta``, else None. A ``meta`` policy takes
    rank 0's dtypes (a ``meta`` build knows no checkpoint's dtype)."""
    built = {n: p.dtype for n, p in policy.named_parameters()}
    on_meta = any(p.is_meta for p in policy.parameters())
    seen = all_gather_objects((built, on_meta))
    if not any(m for _, m in seen):
        return None
    if seen[0][1]:
        raise RuntimeError("trainer=fsdp: rank 0 built its policy on the meta device; rank 0 must load the weights")
    theirs = seen[0][0]
    if built.keys() != theirs.keys():
        diff = sorted(built.keys() ^ theirs.keys())[:5]
        raise RuntimeError(f"trainer=fsdp: this rank built another policy than rank 0 (parameters differ: {diff})")
    for name, p in policy.named_parameters():
        if p.dtype != theirs[name]:
            p.data = p.data.to(theirs[name])  # in place: a tied weight stays tied
    return policy.state_dict() if dist.get_rank() == 0 else {}


def materialize_from_rank0(policy: nn.Module, source: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Fill every rank's shards from rank 0's whole state (one load per node, not one per rank); the
    buffers (RoPE's frequencies, not in the state dict) are broadcast too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for module in policy.modules():
        if any(t.is_meta for t in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False)
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=device)
    set_model_state_dict(policy, dict(source), options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
    for buf in policy.buffers():
        dist.broadcast(buf, src=0)


def loads_on_rank0_only(strategy: Any) -> bool:
    """Whether this process builds its policy on ``meta``: under ``trainer=fsdp`` every rank but 0,
    read from the launcher's environment before any process group exists."""
    target = strategy.get("_target_") if isinstance(strategy, Mapping) else None
    if not (isinstance(target, str) and target.endswith("PolicyFSDPStrategy")):
        return False
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]) > 0
    return int(env.get("NODE_RANK", "0")) > 0 or int(env.get("LOCAL_RANK", "0")) > 0


def agreed_passes(count: int, sharded: bool) -> int:
    """Under FSDP each forward is a collective: every rank runs as many as the busiest one."""
    return max(all_gather_objects(count)) if sharded else count


@torch.no_grad()
def idle_forward(model: nn.Module) -> None:
    """This rank's part of a pass it has no rows for (the other ranks' all-gathers wait for it)."""
    device = local(next(model.parameters())).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)


def idle_passes(model: nn.Module) -> None:
    for _ in range(agreed_passes(0, sharded=True)):
        idle_forward(model)


def streamed_weights(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The state a plain model of the policy holds (LoRA merged), one tensor at a time. Sharded: each
    parameter gathered alone in ``dtype``, a fresh copy (the receiver may hold it past the next
    gather); every rank runs it to the end together."""
    from medsrl.models.lora import merged_weights

    sharded = is_sharded(module)
    yield from merged_weights(module, dtype, copy=sharded, gather=whole if sharded else None)


def host_weights(module: nn.Module, dtype: torch.dtype | None = None, *,
                 adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`streamed_weights` moved to host memory one tensor at a time; ``adapters_only``: a LoRA
    policy's adapters, unmerged, under the PEFT model's names."""
    from medsrl.models.lora import is_adapter_key

    if adapters_only:
        weights = ((n, whole(p.detach(), dtype)) for n, p in module.named_parameters() if is_adapter_key(n))
    else:
        weights = streamed_weights(module, dtype)
    for name, tensor in weights:
        yield name, tensor.cpu()


def export_policy(policy: nn.Module, tokenizer, path, dtype: torch.dtype | None = None, *,
                  merge_on_export: bool = True) -> None:
    """``save_policy`` on every rank, rank 0 writing. Sharded: no rank holds the whole policy on its
    device (the bf16 milestones at 8B did not fit beside the engine's weights)."""
    from medsrl.models.export import save_policy
    from medsrl.models.lora import is_lora

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = None
    if is_sharded(policy):  # every rank gathers, rank 0 keeps
        weights = host_weights(policy, dtype, adapters_only=is_lora(policy) and not merge_on_export)
        state = {name: tensor for name, tensor in weights if rank0}
    if rank0:
        save_policy(policy, tokenizer, path, dtype=dtype, merge_on_export=merge_on_export, state=state)


@contextlib.contextmanager
def full_weights(module: nn.Module) -> Iterator[nn.Module]:
    """A plain model with all the policy's weights (LoRA merged: generation runs plain layers, not two
    adapter matmuls more per projection), freed after the block; every rank together when sharded."""
    from medsrl.models.export import plain_model
    from medsrl.models.lora import is_lora, unwrap_peft

    if not is_sharded(module) and not is_lora(module):
        yield module
        return
    base = unwrap_peft(module)
    twin = plain_model(module, dict(streamed_weights(module)))
    for name, buf in base.named_buffers():  # RoPE's frequencies and the like: not in the state dict
        owner, _, leaf = name.rpartition(".")
        twin.get_submodule(owner)._buffers[leaf] = buf
    twin.generation_config = base.generation_config
    with torch.no_grad():
        yield twin.eval().requires_grad_(False)


def grad_norm(params: list[nn.Parameter], sharded: bool) -> float:
    """The global L2 norm of the gradients (sharded: each rank's squares summed over ranks)."""
    norms = [local(p.grad).detach().float().norm(2) for p in params if p.grad is not None]
    sq = float(torch.stack(norms).square().sum()) if norms else 0.0
    return (all_reduce_sum(sq) if sharded else sq) ** 0.5


def replicate_from_rank0(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` whole on every rank with rank 0's values (the KL reference of a ``meta`` build)."""
    if any(t.is_meta for t in module.parameters()):
        module = module.to_empty(device=device)
    module.to(device)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)
    return module
