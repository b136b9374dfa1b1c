"""The few collectives a multi-process RL step needs, as no-ops in a single process: whatever
must agree across ranks goes through them, over the process group Lightning's strategy starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


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


def all_reduce_sum(value: float) -> float:
    if not is_distributed():
        return value
    nccl = dist.get_backend() == "nccl"  # NCCL takes CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is set on some rank: a decision every rank must take the same way."""
    return all_reduce_sum(float(flag)) > 0 if is_distributed() else bool(flag)


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
    for p, chunk in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = chunk.view_as(p).clone()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an FSDP2 parameter or gradient); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
