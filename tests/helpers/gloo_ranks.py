"""Run a check on several gloo ranks, each in a spawned process: ``fn(rank)`` returns what that
rank saw (JSON-able), and the test reads every rank's result. The group's timeout is short, so a
collective that one rank skips fails the check instead of hanging it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, fn: Callable[[int], dict], out_dir: str, world: int, timeout_s: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def on_gloo_ranks(fn: Callable[[int], dict], out_dir: Path, world: int = 2, timeout_s: int = 60) -> list[dict]:
    """``[fn(0), fn(1), ...]``, each run on its own rank of a ``world``-process gloo group
    (``fn`` must be a module-level function: it is pickled into the processes)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_main, args=(fn, str(out_dir), world, timeout_s), nprocs=world)
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
