"""Live tensor bytes and the largest vocabulary-wide tensor during a block of code: proves that the
fused log-prob path makes no ``[..., V]`` tensor larger than one chunk. The CPU has no
``torch.cuda.max_memory_allocated``, so the peak is the largest running sum of allocator events.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class BlockMemory:
    """What :func:`track_memory` saw."""

    vocab_size: int
    peak_bytes: int = 0  # most bytes allocated in the block and alive at once (allocator events)
    largest_vocab_numel: int = 0  # elements of the largest op output whose last dim is vocab_size
    largest_vocab_shape: tuple[int, ...] = ()
    largest_vocab_bytes: int = 0
    net_bytes: int = 0  # allocated minus freed over the block: what it left alive


def peak_live_bytes(deltas: Iterable[tuple[int, int]]) -> int:
    """The largest running sum of ``(time, +allocated / -freed bytes)`` events in time order; 0 when
    nothing was allocated above the start."""
    in_order = [nbytes for _, nbytes in sorted(deltas, key=lambda e: e[0])]
    return max(itertools.accumulate(in_order, initial=0))


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
            if t.numel() > self.report.largest_vocab_numel:
                self.report.largest_vocab_numel = t.numel()
                self.report.largest_vocab_shape = tuple(t.shape)
                self.report.largest_vocab_bytes = t.numel() * t.element_size()
        return out


@contextlib.contextmanager
def track_memory(vocab_size: int) -> Iterator[BlockMemory]:
    """Measure the block's peak CPU bytes and largest vocabulary-wide op output (slow: tests only)."""
    from torch.profiler import ProfilerActivity, profile

    report = BlockMemory(vocab_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with _VocabOutputs(report):
            yield report
    deltas = [
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).rsplit(".", 1)[-1] == "CPU"
    ]
    report.peak_bytes = peak_live_bytes(deltas)
    report.net_bytes = sum(nbytes for _, nbytes in deltas)
