"""atomic_write: the new file replaces the old one whole, or not at all."""

import os

import pytest

from medsrl.utils.atomic_file import atomic_write


def test_atomic_write_creates_and_replaces(tmp_path):
    path = tmp_path / "a" / "b" / "f.bin"
    assert atomic_write(path, lambda f: f.write(b"one")) == path
    assert path.read_bytes() == b"one"
    atomic_write(str(path), lambda f: f.write(b"two"))
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["f.bin"]


def test_failed_write_keeps_previous_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def broken(f):
        f.write(b"half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_write(path, broken)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
