"""Worker processes that end with the process that owns them, however it ends (even ``kill -9``).
A worker never sees EOF (``ProcessPoolExecutor`` under forkserver / spawn pickles *both* ends of its
call queue into it), so :func:`exit_with_owner` starts a thread that ``os._exit``s once the owner
(pid *and* start time) is gone; a direct child of the owner's main thread also gets
``PR_SET_PDEATHSIG``. A worker in a long C call (an HDBSCAN fit) exits when that is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class ProcessRef:
    """One process, not just a pid: ``start_time`` is /proc's field 22 (None without /proc)."""

    pid: int
    start_time: str | None


@dataclass(frozen=True)
class Owner:
    """The process whose death ends a worker, and whether workers start in its main thread."""

    process: ProcessRef
    main_thread: bool


def _proc_stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state letter, start time) from /proc/<pid>/stat; None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and ")"
    return int(fields[1]), fields[0], fields[19]


def _has_proc() -> bool:
    return Path("/proc/self/stat").exists()


def process_ref(pid: int | None = None) -> ProcessRef:
    pid = os.getpid() if pid is None else pid
    stat = _proc_stat(pid)
    return ProcessRef(pid, stat[2] if stat else None)


def is_running(ref: ProcessRef) -> bool:
    """Whether that very process still runs (a zombie has ended; a reused pid is another one)."""
    if ref.start_time is None or not _has_proc():
        try:
            os.kill(ref.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # it runs, as another user
            return True
        return True
    stat = _proc_stat(ref.pid)
    return stat is not None and stat[1] not in "ZXx" and stat[2] == ref.start_time


def this_owner() -> Owner:
    """This process as the owner of workers started from the calling thread."""
    return Owner(process_ref(), threading.current_thread() is threading.main_thread())


@contextlib.contextmanager
def without_main_import():
    """Start spawn / forkserver workers that skip re-running the parent's ``__main__`` (for
    ``medsrl-train``: ~14 s of CPU each); they run library code only."""
    main = sys.modules["__main__"]
    spec, path = main.__spec__, main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing.spawn.get_preparation_data: nothing to import
    try:
        yield
    finally:
        main.__spec__ = spec
        main.__dict__.update({"__file__": path} if path else {})


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL us when the thread that forked us exits (a no-op where unsupported)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def exit_with_owner(owner: Owner, poll_s: float = 0.2) -> None:
    """Make this worker exit when ``owner`` ends; call it first (also a ``ProcessPoolExecutor`` initializer)."""
    if owner.main_thread and os.getppid() == owner.process.pid:
        set_parent_death_signal()
    # a direct child is re-parented when its parent dies: the test that needs no /proc
    parent = owner.process.pid if os.getppid() == owner.process.pid else None
    if not _owner_alive(owner.process, parent):  # it died before we got here
        os._exit(1)
    threading.Thread(
        target=_watch, args=(owner.process, parent, poll_s), name="medsrl-owner-watch", daemon=True
    ).start()


def _owner_alive(owner: ProcessRef, parent: int | None) -> bool:
    return is_running(owner) and (parent is None or os.getppid() == parent)


def _watch(owner: ProcessRef, parent: int | None, poll_s: float) -> None:
    while _owner_alive(owner, parent):
        time.sleep(poll_s)
    os._exit(1)  # nothing to flush: the owner that would read our results is gone
