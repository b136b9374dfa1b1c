"""Live tensor bytes and the largest vocabulary-wide tensor during a block of code.

Proves what the fused log-prob path (``algo/logprobs.py``) promises: no ``[..., V]`` tensor
larger than one chunk of tokens, forward or backward. The CPU has no
``torch.cuda.max_memory_allocated``, so the peak is the largest running sum of the allocator's
events (``torch.profiler``, ``profile_memory=True``: op temporaries and autograd's thread
included), and a ``TorchDispatchMode`` keeps the shape of the largest new (not a view of an
input) op output whose last dimension is the vocabulary, backward included::

    with track_memory(vocab_size=V) as mem:
        f(hidden).sum().backward()
    mem.peak_bytes, mem.largest_vocab_numel, mem.largest_vocab_shape
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class BlockMemory:
    """What :func:`track_memory` saw; filled when its block exits (``peak_bytes``) or as it runs."""

    vocab_size: int
    peak_bytes: int = 0  # most bytes allocated in the block and alive at once (allocator events)
    largest_vocab_numel: int = 0  # elements of the largest op output whose last dim is vocab_size
    largest_vocab_shape: tuple[int, ...] = ()
    largest_vocab_bytes: int = 0
    vocab_outputs: int = 0  # how many op outputs had the vocabulary as last dimension
    net_bytes: int = 0  # allocated minus freed over the block: what it left alive


def peak_live_bytes(deltas: Iterable[tuple[int, int]]) -> int:
    """The largest running sum of ``(time, +bytes allocated / -bytes freed)`` events taken in time
    order; 0 when nothing was allocated above the start (frees of older tensors go below it)."""
    live = peak = 0
    for _, nbytes in sorted(deltas, key=lambda e: e[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


class _VocabOutputs(TorchDispatchMode):
    """Records the largest ``[..., vocab_size]`` output of any aten op run under it."""

    def __init__(self, report: BlockMemory) -> None:
        super().__init__()
        self.report = report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] != self.report.vocab_size:
                continue
            if t.untyped_storage().data_ptr() in inputs:  # a view of an input (W.t()): no new memory
                continue
            self.report.vocab_outputs += 1
            if t.numel() > self.report.largest_vocab_numel:
                self.report.largest_vocab_numel = t.numel()
                self.report.largest_vocab_shape = tuple(t.shape)
                self.report.largest_vocab_bytes = t.numel() * t.element_size()
        return out


def _memory_deltas(prof, device_type: str) -> list[tuple[int, int]]:
    """``(start ns, bytes)`` of the profiler's allocator events on ``device_type``."""
    want = torch.device(device_type).type.upper()
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and str(e.device_type()).rsplit(".", 1)[-1] == want:
            out.append((e.start_ns(), e.nbytes()))
    return out


@contextlib.contextmanager
def track_memory(vocab_size: int, device_type: str = "cpu") -> Iterator[BlockMemory]:
    """Measure the block: peak bytes on ``device_type`` (allocator events) and the largest
    vocabulary-wide op output. Slow (a Python call per op): for tests and benchmarks only."""
    from torch.profiler import ProfilerActivity, profile

    report = BlockMemory(vocab_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        with _VocabOutputs(report):
            yield report
    deltas = _memory_deltas(prof, device_type)
    report.peak_bytes = peak_live_bytes(deltas)
    report.net_bytes = sum(nbytes for _, nbytes in deltas)
