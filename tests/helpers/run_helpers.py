"""Helpers for end-to-end tests: compose the real Hydra config and run it in a temp dir."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))


def compose_train(
    out_dir: Path, overrides: list[str] | None = None, debug: str | None = "fast", cache_dir: Path | None = None
):
    """The train config with ``overrides``, writing everything under ``out_dir``."""
    base = [f"paths.output_dir={out_dir}", f"paths.cache_dir={cache_dir or out_dir.parent / 'cache'}"]
    if debug:
        base.append(f"debug={debug}")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=base + list(overrides or []))


# The smallest config a run parses: one stage of generated problems (everything else defaults).
BASE_CONFIG = {"data": {"stages": [{"name": "A", "start_step": 0, "datasets": [
    {"name": "a", "source": {"_target_": "medsrl.data.arithmetic.generate_arithmetic", "num": 4}}]}]}}


def config_problems(values: dict) -> list[str]:
    """The problems ``RunConfig.parse`` names in ``values`` over :data:`BASE_CONFIG` (its lists
    replaced, its mappings merged); [] when it parses."""
    from omegaconf import OmegaConf

    from medsrl.run_config import RunConfig

    try:
        RunConfig.parse(OmegaConf.merge(OmegaConf.create(BASE_CONFIG), OmegaConf.create(values)))
    except ValueError as err:
        return [line.strip() for line in str(err).splitlines()[1:]]
    return []


def read_metrics(out_dir: Path) -> dict[int, dict[str, float]]:
    """Per-step metrics from the CSV logger (``debug=fast`` logs to csv): {step: {name: value}}."""
    path = out_dir / "csv" / "metrics.csv"
    rows: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and v not in ("", None):
                    rows.setdefault(step, {})[k] = float(v)
    return rows


# A micro model (22k parameters) warm-started for a few seconds: it writes the answer format with a
# \boxed{} (mostly wrong answers), which is what MEDS needs to have features to work with.
MICRO_WARM_START = [
    "model.warm_start={steps: 300, batch_size: 32, lr: 1.0e-2, warmup_steps: 10, num_examples: 2000,"
    " eval_examples: 8, eval_max_new_tokens: 48, system_prompt: null}",
    "data.template.system_prompt=null",
    "rollout.max_new_tokens=48",
    "algorithm.plugins.overlong.buffer_length=4",
]


# A 3-step MEDS + R3 run whose 4 prompts split into two equal shards (tests/e2e/test_distributed.py).
TWO_RANK_RUN = [
    "debug=fast",
    *MICRO_WARM_START,
    "algorithm=meds_r3",
    # reflection adds prompts: an odd number would cut the ranks' shards off the engine's
    # sampling chunks, and one process would sample them differently
    "algorithm.plugins.r3.reflection.enabled=false",
    "algorithm.plugins.meds.snapshot_every_n_steps=1",
    "algorithm.plugins.meds.mixed_groups_only=false",  # no DAPO filter here: remember every group
    "data.prompts_per_step=4",
    "rollout.n=4",
    "rollout.max_batch_size=8",  # 2 prompts per generate chunk = one rank's shard
    "data.stages=[{name: A, start_step: 0, datasets: [{name: a, weight: 1.0, source: "
    "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 8, level: 1, split: train}}]}]",
    "trainer.max_steps=3",
    "export_policy=true",
    # validation at steps 0, 2 and 3 (the end) on the 4 held-out problems, in sampling chunks of 2
    # problems: one chunk per rank, drawn as one process draws it
    "callbacks.pass_at_k.every_n_steps=2",
    "callbacks.pass_at_k.n=2",
    "callbacks.pass_at_k.batch_size=4",
]

CPU_TWO_PROCESSES = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def train_in_subprocess(out: Path, cache: Path, overrides: list[str], timeout_s: int = 900) -> str:
    """``medsrl-train`` with ``overrides`` in its own process group, so a hang (a collective one
    rank never joins) fails the test and leaves no stray ranks behind. Returns its output."""
    import pytest

    cmd = [
        sys.executable,
        "-m",
        "medsrl.train",
        f"hydra.run.dir={out}",
        f"paths.cache_dir={cache}",
        *overrides,
    ]
    # tests/ too: a run may take a test's callback (+callbacks.x={_target_: fsdp_probe.GatherProbe})
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "helpers")])}
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
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("training hung (a collective not joined by every rank?):\n" + output[-5000:])
    assert proc.returncode == 0, output[-8000:]
    return output


def assert_matches_one_process(one: Path, two: Path, two_metrics: dict[int, dict[str, float]]) -> None:
    """A 2-process run of ``TWO_RANK_RUN`` (its metrics, its output dir) made one process's run:
    the same per-step metrics, MEDS memory and final weights."""
    import pytest
    import torch
    from safetensors.torch import load_file

    a, b = read_metrics(one), two_metrics
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
    for step in (0, 2, 3):  # validation, sampled in shares and all-gathered
        for name in ["val/accuracy", "val/pass@2", "val/num_samples", "val/distinct_answers"]:
            assert b[step][name] == pytest.approx(a[step][name], rel=1e-5, abs=1e-6), (step, name)

    for step in range(3):
        assert b[step]["train/r3/history/responses"] == a[step]["train/r3/history/responses"]
    mem = lambda run: torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]  # noqa: E731
    from medsrl.methods.r3.history import ResponseHistory

    ha, hb = ResponseHistory(), ResponseHistory()
    ha.load_state_dict(mem(one)["plugin:r3"]["history"])
    hb.load_state_dict(mem(two)["plugin:r3"]["history"])
    assert ha.keys() == hb.keys() and ha.num_responses() == hb.num_responses() > 0
    for k in ha.keys():
        for x, y in zip(ha.responses(k), hb.responses(k), strict=True):
            assert ((x.token_ids, x.correct, x.step, x.reward)
                    == (y.token_ids, y.correct, y.step, pytest.approx(y.reward)))
            assert (x.logprobs is None) == (y.logprobs is None)
            if x.logprobs is not None:
                # float rounding only: a rank's shared-prompt forward runs 2 prompts where one
                # process runs 4 (up to 1.1e-5 seen); a wrong row would be off by 0.1 or more
                assert x.logprobs == pytest.approx(y.logprobs, abs=5e-5)
    key = "plugin:meds"
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
        # float rounding only: AdamW divides each step by the gradient's own scale, so an element
        # whose gradient is near zero amplifies a rounding difference (8e-6 on one of 2,048 seen,
        # at lr 1e-3); a missed gradient or a wrong row would be off by about the lr
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=2e-5, msg=name)


class KilledOnCall:
    """``real`` that raises ``KeyboardInterrupt`` at its ``n``-th call, as a kill mid-run would stop
    it (resume tests); ``calls`` counts the calls (set it to keep counting after the kill)."""

    def __init__(self, real, n: int) -> None:
        self.real, self.n, self.calls = real, n, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt("killed")
        return self.real(*args, **kwargs)


def wandb_run_dirs(out_dir: Path) -> list[Path]:
    """The offline W&B runs a training run wrote under its output dir (``logger=wandb``)."""
    return sorted((out_dir / "wandb").glob("offline-run-*"))


def read_wandb_records(run_dir: Path, wait_s: float = 30.0) -> list:
    """The records of an offline W&B run's ``run-<id>.wandb`` file, as wandb's protobuf
    ``Record``s (what ``wandb sync`` uploads): a LevelDB-style log of 32 KiB blocks after a 7-byte
    header (``:W&B``, magic, version), each record chunk behind a 7-byte header (CRC, length,
    type: 1 full, 2 first, 3 middle, 4 last).

    ``run.finish()`` can return before wandb's writer process has flushed the file (seen on a
    loaded machine): read again until the run's ``exit`` record is there, for up to ``wait_s``."""
    import time

    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = _wandb_records(path.read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_records(data: bytes) -> list:
    import struct

    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:  # a record still being written
            break
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run_contents(run_dir: Path) -> dict:
    """An offline W&B run, read back: ``run`` (the run record: display name, tags), ``config``
    and ``summary`` ({key: value}), ``history`` (one {key: value} per logged row); nested keys
    joined with dots, values decoded from JSON."""
    import json

    out: dict = {"run": None, "config": {}, "summary": {}, "history": []}
    key = lambda item: item.key or ".".join(item.nested_key)  # noqa: E731
    for record in read_wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
            out["config"].update({key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in record.history.item})
    return out
