"""The few collectives a multi-process RL step needs, as no-ops in a single process.

Lightning's strategy (DDP / FSDP) starts the processes and the process group; these helpers only
talk over it. Everything that must agree across ranks (which groups survive dynamic sampling,
the token count that normalises the loss, the MEDS memory) goes through them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_size() -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shard_bounds(num: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of ``num`` items for ``rank`` of ``size``; earlier ranks get
    the remainder (10 over 4 ranks: 3, 3, 2, 2)."""
    base, extra = divmod(num, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def all_gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` (``[obj]`` in a single process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _collective_device() -> torch.device:
    """Where a small tensor must live for this process group: NCCL takes CUDA tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    """Sum of a Python number over ranks."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of ``params`` over ranks, in one flat buffer; a parameter without a
    gradient on this rank takes part with zeros, so every rank makes the same single call."""
    if not is_distributed() or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_backend() == "nccl" and flat.device.type != "cuda":
        raise RuntimeError("NCCL needs CUDA tensors; use the gloo backend on CPU")
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
