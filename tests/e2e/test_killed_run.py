"""A MEDS run killed with SIGKILL leaves no process behind: the grader workers, the HDBSCAN
re-fit worker, the forkserver and multiprocessing's resource tracker all exit by themselves.

The run starts in its own session, so whatever survives the check is still in its process group
and the test can clean up without touching anything it did not start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medsrl.utils.lifetime import ProcessRef, is_running
from process_tree import descendants
from run_helpers import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc"),
]


def _parent_and_state(pid: int) -> tuple[int, str]:
    fields = (text := Path(f"/proc/{pid}/stat").read_text())[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def _states(tree: list[ProcessRef]) -> dict[int, str]:
    return {ref.pid: f"{_cmdline(ref.pid)[:80]} [{_parent_and_state(ref.pid)[1]}]" for ref in tree}


def _settled(trainer: int, tree: list[ProcessRef]) -> bool:
    """A grader worker (spawned by the trainer) and a re-fit worker (forked by the forkserver)
    exist, and every helper and worker is asleep: done importing, waiting for work."""
    try:
        info = {ref.pid: _parent_and_state(ref.pid) for ref in tree}
    except (OSError, ValueError):
        return False
    grader = any(ppid == trainer and "spawn_main" in _cmdline(pid) for pid, (ppid, _) in info.items())
    refit = any(ppid != trainer for ppid, _ in info.values())
    return grader and refit and all(state == "S" for _, state in info.values())


def test_sigkill_leaves_no_worker_behind(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "medsrl.train", f"hydra.run.dir={out}", f"paths.cache_dir={tmp_path / 'cache'}",
        "debug=fast", "algorithm=meds", "trainer.max_steps=10000", "callbacks.pass_at_k.every_n_steps=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    log = open(tmp_path / "train.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900  # generous: a loaded machine starts workers slowly
        calm = 0  # polls in a row with every worker up and idle
        while calm < 3 or not any((out / "checkpoints").glob("step_*.ckpt")):  # a step was taken
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-5000:]
            assert time.monotonic() < deadline, f"workers never settled: {_states(descendants(proc.pid))}"
            time.sleep(0.5)
            calm = calm + 1 if _settled(proc.pid, descendants(proc.pid)) else 0
        tree = descendants(proc.pid)
        names = {ref.pid: _cmdline(ref.pid)[:120] for ref in tree}
        assert len(tree) >= 4, names  # resource tracker, forkserver, re-fit worker, grader worker

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while any(map(is_running, tree)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        left = {ref.pid: names[ref.pid] for ref in tree if is_running(ref)}
        assert not left, f"alive 10 s after the trainer was killed: {left}"
        print(f"{len(tree)} descendants, all gone {time.monotonic() - t0:.2f} s after the kill: "
              f"{sorted(names.values())}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # our own process group only
        proc.wait()
        log.close()
