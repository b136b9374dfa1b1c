"""Atomic file writes: a crash mid-write leaves the previous file at the path intact."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Write ``path`` through ``write(f)`` so that readers see either the old or the new file.

    The bytes go to a temp file in the same directory (same filesystem, so ``os.replace`` is an
    atomic rename), which is flushed and fsynced before the rename; the directory is fsynced
    after it so the rename itself survives a power loss. If ``write`` (or anything after it)
    raises, the temp file is removed and the exception propagates. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (POSIX); a no-op where directories cannot be
    opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)
