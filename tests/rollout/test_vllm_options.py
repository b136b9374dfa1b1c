"""The vLLM engine's options for one rank of a multi-process run (no vLLM needed: pure logic)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from medsrl.rollout.vllm import _multi_process_options


def test_single_process_needs_no_options():
    assert not dist.is_initialized()
    assert _multi_process_options(tensor_parallel_size=4) == {}


def _fake_group(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: size)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)


def test_a_rank_joins_the_trainers_group_and_gets_its_rank(monkeypatch):
    _fake_group(monkeypatch, rank=3, size=4)
    # a private environment: the function writes RANK, which must not leak into later tests
    # (a training subprocess that inherits RANK=3 believes it is not rank 0 and logs nothing)
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env["LOCAL_RANK"] = "1"  # set by the launcher: kept
    monkeypatch.setattr(os, "environ", env)
    assert _multi_process_options(1) == {"distributed_executor_backend": "external_launcher"}
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1"


def test_tensor_parallel_engines_are_refused_with_several_ranks(monkeypatch):
    _fake_group(monkeypatch, rank=0, size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        _multi_process_options(2)
