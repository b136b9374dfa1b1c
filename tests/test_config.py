"""Typed settings (src/medsrl/config.py)."""

from __future__ import annotations

import os
from pathlib import Path

from medsrl.config import MAX_GRADER_WORKERS, GraderConfig, grader_workers


def test_grader_workers_follow_the_cores_split_between_a_nodes_processes(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert grader_workers() == MAX_GRADER_WORKERS == 16
    assert grader_workers(processes_per_node=8) == 8
    assert grader_workers(processes_per_node=128) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert grader_workers() == 2
    assert GraderConfig().workers() == 2  # null: one per core
    assert GraderConfig(num_workers=0).workers(8) == 0  # as configured (0: in-process)


def test_every_fsdp_experiment_checkpoints_in_shards():
    """A full state dict has rank 0 gather the weights and both AdamW moments (~91 GB at 7B) at
    every checkpoint, and every rank gather them again at resume; sharded checkpoints (the
    default of trainer=fsdp) write and read each rank's shard only."""
    from run_helpers import ROOT, compose_train

    fsdp = []
    for path in sorted((ROOT / "configs" / "experiment").glob("[!_]*.yaml")):
        name = path.stem
        cfg = compose_train(Path("/tmp/unused"), [f"experiment={name}"], debug=None)
        if "fsdp" in str(cfg.trainer.get("strategy", "")).lower():
            fsdp.append(name)
            assert cfg.trainer.strategy.state_dict_type == "sharded", name
    assert sorted(fsdp) == ["qwen2.5-math-7b_dapo", "qwen2.5-math-7b_meds", "qwen3-8b_dapo", "qwen3-8b_meds"]
