"""Typed settings (src/medsrl/config.py)."""

from __future__ import annotations

import os

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
