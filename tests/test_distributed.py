"""Two processes (Lightning DDP or FSDP, gloo on CPU) against one process with the same global batch.

Each rank generates for its own half of the prompts; the MEDS memory is all-gathered every step
and compared across ranks (a mismatch stops the run), and the result must be the run of one
process: the same metrics, the same memory, the same weights. The FSDP run stops after step 2
and resumes from its (full) checkpoint for step 3, so its checkpoint is checked too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from medsrl.module import _my_share
from run_helpers import MICRO_WARM_START, ROOT, read_metrics

pytestmark = pytest.mark.slow

COMMON = [
    "debug=fast",
    *MICRO_WARM_START,
    "algorithm=meds",
    "algorithm.meds.snapshot_every_n_steps=1",  # replicas compared every step
    "data.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_batch_size=8",  # 2 prompts per generate chunk = one rank's shard
    "data.stages=[{name: A, start_step: 0, datasets: [{name: a, weight: 1.0, source: "
    "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 8, level: 1, split: train}}]}]",
    "trainer.max_steps=3",
    "export_policy=true",
    "validate_at_start=false",
    "callbacks.pass_at_k.every_n_steps=0",
]


def _train(out, cache, extra):
    """``medsrl-train`` in its own process group, so a hang (a collective one rank never joins)
    fails the test and leaves no stray ranks behind."""
    cmd = [
        sys.executable,
        "-m",
        "medsrl.train",
        f"hydra.run.dir={out}",
        f"paths.cache_dir={cache}",
        *COMMON,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("training hung (a collective not joined by every rank?):\n" + output[-5000:])
    assert proc.returncode == 0, output[-8000:]


CPU_2 = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    _train(root / "run", root / "cache", [])
    return root


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, one_process, strategy):
    one, two = one_process / "run", tmp_path / "two"
    cache = one_process / "cache"  # the same warm start
    if strategy == "ddp":
        _train(two, cache, [f"trainer={strategy}", *CPU_2])
    else:
        first = tmp_path / "first"
        _train(first, cache, [f"trainer={strategy}", *CPU_2, "trainer.max_steps=2"])
        ckpt = torch.load(first / "checkpoints" / "last.ckpt", weights_only=False)
        policy = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
        shapes = {k: tuple(v.shape) for k, v in policy.items()}
        assert shapes["policy.model.embed_tokens.weight"][0] > 1  # whole tensors, not shards
        plain = torch.load(one / "checkpoints" / "last.ckpt", weights_only=False)
        assert shapes == {k: tuple(v.shape) for k, v in plain["state_dict"].items() if k.startswith("policy.")}
        opt, plain_opt = ckpt["optimizer_states"][0]["state"], plain["optimizer_states"][0]["state"]
        assert opt.keys() == plain_opt.keys()  # whole AdamW states, in the plain layout
        assert all(opt[i]["exp_avg"].shape == plain_opt[i]["exp_avg"].shape for i in opt)
        _train(two, cache, [f"trainer={strategy}", *CPU_2, f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"])

    a = read_metrics(one)
    b = read_metrics(first if strategy == "fsdp" else two)
    if strategy == "fsdp":
        b.update({s: m for s, m in read_metrics(two).items() if s >= 2})
    for step in range(3):
        for name in [
            "train/acc",
            "train/reward",
            "train/score",
            "train/meds/penalty_mean",
            "train/meds/memory_entries",
            "train/meds/memory_keys",
            "train/num_responses",
            "train/grad_norm",
        ]:
            # per-rank means averaged over two equal shards = the global mean
            expected = a[step][name] / (2 if name == "train/num_responses" else 1)
            assert b[step][name] == pytest.approx(expected, rel=1e-4, abs=1e-6), (step, name)
    assert a[2]["train/meds/penalty_max"] > 0  # the memory did shape rewards

    mem = lambda run: torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]  # noqa: E731
    key = next(k for k in mem(one) if "ErrorMemoryCallback" in k)
    ea, eb = mem(one)[key]["memory"]["entries"], mem(two)[key]["memory"]["entries"]
    assert [(e["key"], e["correct"]) for e in ea] == [(e["key"], e["correct"]) for e in eb]
    for x, y in zip(ea, eb, strict=True):
        torch.testing.assert_close(x["features"], y["features"], rtol=1e-5, atol=1e-5)

    wa, wb = (
        load_file(one / "policy" / "model.safetensors"),
        load_file(two / "policy" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dynamic_sampling_share_keeps_the_first_groups_in_round_then_rank_order():
    # rank 0 kept 2 then 3 groups (rounds 0, 1); rank 1 kept 1 then 4; target 5:
    # round 0 -> r0: 2, r1: 1 (3 so far); round 1 -> r0: 2 (full), r1: 0
    counts = [[2, 3], [1, 4]]
    assert _my_share(counts, 0, 5) == [2, 2]
    assert _my_share(counts, 1, 5) == [1, 0]
    assert _my_share([[3, 9]], 0, 8) == [3, 5]  # one process: the first 8 in round order
