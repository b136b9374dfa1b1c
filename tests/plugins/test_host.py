"""The plug-in host: hook order, token stats, and the one shared-state mechanism (an all-gather
of each step's additions), on one process and on 2 gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from medsrl.plugins import Plugin, PluginHost, StepContext
from medsrl.step.metrics import PhaseTimer


class KeyCounter(Plugin):
    """Counts, per prompt key, the responses seen by any rank: replicated state."""

    name = "counter"

    def __init__(self, diverge: bool = False) -> None:
        self.counts: dict[str, int] = {}
        self.diverge = diverge

    def step_additions(self, rollouts, ctx):
        return list(rollouts.keys)

    def commit(self, additions, ctx):
        for keys in additions:
            for k in keys:
                self.counts[k] = self.counts.get(k, 0) + 1
        if self.diverge and dist.is_initialized() and dist.get_rank() == 1:
            self.counts["only-on-rank-1"] = 1

    def state_dict(self):
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state):
        self.counts = dict(state["counts"])


def _ctx(step=0):
    return StepContext(step, None, PhaseTimer(), 1)


def test_hooks_run_in_order_and_additions_commit_once_per_step():
    calls = []

    class Tag(Plugin):
        def __init__(self, name):
            self.name = name

        def transform_groups(self, groups, ctx):
            calls.append(self.name)
            return groups + [self.name]

    assert PluginHost([Tag("a"), Tag("b")]).fill_batch([], None, None, _ctx()) == ["a", "b"]
    assert calls == ["a", "b"]
    counter = KeyCounter()
    PluginHost([counter]).commit(SimpleNamespace(keys=["x", "x", "y"]), _ctx())
    assert counter.counts == {"x": 2, "y": 1}


def test_token_stats_are_asked_for_by_name_and_unknown_ones_fail_at_start():
    class WantsEntropy(Plugin):
        token_stats = ("entropy",)

    class WantsOwn(Plugin):
        name = "own"
        token_stats = ("top1",)

        def token_reducers(self):
            return {"top1": lambda logits, labels: logits.max(-1).values}

    class WantsUnknown(Plugin):
        name = "bad"
        token_stats = ("nonsense",)

    assert PluginHost([]).reducers == {}  # nobody asks: the forward computes nothing extra
    host = PluginHost([WantsEntropy(), WantsOwn()])
    assert sorted(host.reducers) == ["entropy", "top1"]
    logits = torch.tensor([[[0.0, 0.0], [2.0, -1.0]]])
    torch.testing.assert_close(host.reducers["top1"](logits, None), torch.tensor([[0.0, 2.0]]))
    with pytest.raises(ValueError, match="'bad' asks for token stat 'nonsense'"):
        PluginHost([WantsUnknown()])


def test_two_plugins_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two plug-ins named"):
        PluginHost([KeyCounter(), KeyCounter()])


def _rank_worker(rank: int, init_file: str, out_dir: str, diverge: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        plugin = KeyCounter(diverge=diverge)
        host = PluginHost([plugin])
        for step in range(3):  # each rank sees its own prompts
            host.commit(SimpleNamespace(keys=[f"r{rank}"] * (rank + 1) + [f"s{step}"]), _ctx(step))
        torch.save(plugin.state_dict(), f"{out_dir}/state{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_state_is_identical_on_two_gloo_ranks_and_round_trips_through_a_checkpoint(tmp_path):
    mp.spawn(_rank_worker, args=(str(tmp_path / "init"), str(tmp_path), False), nprocs=2)
    a, b = (torch.load(tmp_path / f"state{r}.pt") for r in (0, 1))
    assert a == b == {"counts": {"r0": 3, "s0": 2, "r1": 6, "s1": 2, "s2": 2}}
    fresh = KeyCounter()
    fresh.load_state_dict(torch.load(tmp_path / "state0.pt"))  # what Lightning restores
    assert fresh.counts == a["counts"]
    restored = KeyCounter()
    restored.load_state_dict(a)
    assert restored.digest() == fresh.digest()


@pytest.mark.slow
def test_diverging_replicas_stop_the_run_naming_the_plugin(tmp_path):
    with pytest.raises(Exception, match="state of plug-in 'counter' differs across ranks"):
        mp.spawn(_rank_worker, args=(str(tmp_path / "init"), str(tmp_path), True), nprocs=2)
