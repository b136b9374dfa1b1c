"""Atomic file writes: a crash mid-write leaves the previous file at the path intact."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], mode: int | None = None) -> Path:
    """Write ``path`` through ``write(f)`` so that readers see either the old or the new file: a
    temp file beside it (so ``os.replace`` is an atomic rename) is fsynced, renamed, and the
    directory fsynced. ``mode``: the file's permissions (default mkstemp's 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with contextlib.suppress(OSError):  # make the rename durable, where the filesystem can
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    """``atomic_write`` of UTF-8 text, readable like any file (not mkstemp's 0600)."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")), mode)

