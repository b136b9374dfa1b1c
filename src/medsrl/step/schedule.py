"""The distributed bookkeeping of a policy update. The ranks agree on the number of mini-batch
updates ``U``, and a rank's part of update ``k`` is its local groups ``k, k + U, ...``, so every
update has rows on every rank (as verl; ranges of global groups would leave most ranks idle), or,
given the groups' places in the step (``global_index``, ``step/balance.py``), group ``i`` goes to
update ``i mod U``: one process's updates. The ranks also agree on the global token and sequence
counts, and under FSDP (every backward a collective) on the number of passes and a loss weight of
the world size. The collectives are injected (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from medsrl.step.balance import num_updates
from medsrl.step.micro_batches import plan_micro_batches
from medsrl.utils.distributed import (
    all_gather_objects,
    all_reduce_grads,
    all_reduce_sum,
    rank_and_size,
)


class UpdateSchedule:
    """Mini-batches of whole groups and micro-batch passes for this rank, agreed by all ranks."""

    def __init__(
        self,
        group_counts: list[int],
        rank: int,
        *,
        per_update: int | None,
        micro_batch_size: int,
        max_tokens: int | None = None,
        sharded: bool = False,
        reduce_sum: Callable[[float], float] = all_reduce_sum,
        gather: Callable[[Any], list[Any]] = all_gather_objects,
        global_index: list[int] | None = None,
    ) -> None:
        self.world = len(group_counts)
        self.sharded = sharded
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self._reduce_sum, self._gather = reduce_sum, gather
        updates = num_updates(sum(group_counts), per_update)
        local = torch.arange(group_counts[rank])
        self.mini_batches: list[torch.Tensor] = [local[k::updates] for k in range(updates)]
        if global_index is not None:
            where = torch.tensor(global_index, dtype=torch.long) % max(updates, 1)
            self.mini_batches = [local[where == k] for k in range(updates)]

    @classmethod
    def for_this_rank(
        cls, num_groups: int, *, per_update, micro_batch_size, max_tokens=None, sharded, global_index=None
    ) -> UpdateSchedule:
        """The schedule of this process, from every rank's group count (one all-gather)."""
        counts = all_gather_objects(num_groups)
        return cls(counts, rank_and_size()[0], per_update=per_update, micro_batch_size=micro_batch_size,
                   max_tokens=max_tokens, sharded=sharded, global_index=global_index)

    def rows(self, group_ids: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(torch.isin(group_ids, groups)).flatten()

    def totals(self, response_mask: torch.Tensor) -> tuple[float, float]:
        """Global (tokens, sequences) of a mini-batch, given this rank's rows' response mask."""
        return (
            self._reduce_sum(float(response_mask.sum())),
            self._reduce_sum(float(response_mask.shape[0])),
        )

    def micro_batches(
        self, rows: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor
    ) -> list[tuple[torch.Tensor, float]]:
        """``(rows, loss weight)`` per pass of a mini-batch. Under FSDP every rank runs as many
        passes as the busiest (the extra ones: row 0, weight 0), a real one weighing the world size."""
        parts = plan_micro_batches(rows, prompt_lengths, response_lengths,
                                   max_rows=self.micro_batch_size, max_tokens=self.max_tokens)
        num = max(self._gather(len(parts))) if self.sharded else len(parts)
        weight = float(self.world) if self.sharded else 1.0
        idle = (torch.zeros(1, dtype=torch.long), 0.0)
        return [(part, weight) for part in parts] + [idle] * (num - len(parts))

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is set on some rank (a non-finite loss drops the update everywhere)."""
        return self._reduce_sum(float(flag)) > 0

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks (DDP); FSDP's backward already reduce-scattered them."""
        if not self.sharded:
            all_reduce_grads(params)

