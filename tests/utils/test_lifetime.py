"""Workers that end with their owner: the process identity checks, and real owners killed with
SIGKILL whose workers (a plain child, the MEDS re-fit pool, the grader) must all go away."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from medsrl.utils.lifetime import ProcessRef, is_running, process_ref, this_owner
from process_tree import descendants

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_this_process_runs_and_a_reused_pid_does_not_count():
    me = process_ref()
    assert me.pid == os.getpid() and is_running(me)
    if me.start_time is not None:
        assert not is_running(ProcessRef(me.pid, str(int(me.start_time) + 1)))
    assert this_owner().main_thread


@linux_only
def test_a_child_counts_until_it_dies_and_a_zombie_is_dead():
    child = subprocess.Popen(["sleep", "30"])
    try:
        ref = process_ref(child.pid)
        assert is_running(ref) and ref in descendants(os.getpid())
        child.kill()
        deadline = time.monotonic() + 5
        while is_running(ref) and time.monotonic() < deadline:  # not reaped yet: a zombie
            time.sleep(0.01)
        assert not is_running(ref)
    finally:
        child.kill()
        child.wait()
    assert not is_running(ref) and ref not in descendants(os.getpid())


def _kill_owner_and_wait(script: str, timeout_s: float = 120) -> tuple[list[ProcessRef], float]:
    """Run ``script`` as an owner in its own session; once it prints ``ready`` SIGKILL it and
    return its descendants at that moment and the seconds until the last of them was gone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = owner.stdout.readline()  # blocks until ready (or the script failed)
        assert line.strip() == "ready", f"owner did not start: {line!r}"
        tree = descendants(owner.pid)
        owner.kill()
        owner.wait()
        t0 = time.monotonic()
        while any(map(is_running, tree)) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        return tree, time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)  # only what this test started
        owner.wait()


@linux_only
@pytest.mark.parametrize("main_thread", [True, False], ids=["pdeathsig", "watcher-thread"])
def test_a_plain_worker_exits_when_its_owner_is_killed(main_thread):
    """``main_thread=True``: the kernel's parent-death signal; False: the polling thread alone."""
    script = f"""
        import subprocess, sys, time
        from medsrl.utils.lifetime import Owner, process_ref
        owner = Owner(process_ref(), {main_thread})
        code = ("import time; from medsrl.utils.lifetime import *; "
                f"exit_with_owner({{owner!r}}); print('armed', flush=True); time.sleep(60)")
        worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "armed"
        print("ready", flush=True)
        time.sleep(60)
    """
    tree, seconds = _kill_owner_and_wait(script)
    assert len(tree) == 1
    assert not any(map(is_running, tree)) and seconds < 2


@linux_only
def test_refit_pool_grader_forkserver_and_resource_tracker_all_exit():
    """The real pools, warmed up (the grader's worker has run math-verify, the re-fit worker a
    fit); after the owner's SIGKILL nothing of multiprocessing's is left either."""
    script = """
        import numpy as np
        from medsrl.methods.meds.refit import BackgroundRefitter
        from medsrl.reward.grader import MathGrader
        refit = BackgroundRefitter(num_workers=1)
        refit.submit("k", np.random.default_rng(0).normal(size=(16, 4)).astype("float32"))
        assert refit.wait("k") is not None
        grader = MathGrader(num_workers=1).start()
        assert grader.grade("\\\\boxed{\\\\frac{1}{2}}", "1/2").score == 1.0
        assert grader.stats["fast_path"] == 0  # went through the worker
        print("ready", flush=True)
        import time; time.sleep(120)
    """
    tree, seconds = _kill_owner_and_wait(script)
    assert len(tree) >= 4, tree  # resource tracker, forkserver, re-fit worker, grader worker
    assert not any(map(is_running, tree)), f"survivors: {[r for r in tree if is_running(r)]}"
    assert seconds < 5


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_without_main_import_skip_the_parents_main_module(tmp_path, monkeypatch, method):
    """A spawn / forkserver child re-runs the parent's ``__main__`` (``medsrl-train``'s: Lightning
    and transformers, seconds each) unless started under ``without_main_import``."""
    import importlib.util
    import multiprocessing as mp
    import types

    from medsrl.utils.lifetime import without_main_import

    marker, script = tmp_path / "main_ran", tmp_path / "heavy_main.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('x')\n")
    main = types.ModuleType("__main__")
    main.__spec__, main.__file__ = importlib.util.spec_from_file_location("heavy_main", script), str(script)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "__main__", main)

    def run_child():
        child = mp.get_context(method).Process(target=time.sleep, args=(0,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0

    with without_main_import():
        run_child()
    assert main.__spec__.name == "heavy_main" and main.__file__ == str(script)  # restored
    assert not marker.exists()
    run_child()  # the default: the child imports heavy_main
    assert marker.exists()
