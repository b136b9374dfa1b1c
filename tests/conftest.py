"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import platform

# PyTorch's CPU kernels are chosen per machine (AVX2, AVX-512) and round differently; a warm
# start of many steps carries the difference into every later number. The recorded figures
# (tests/golden/, resume equality across processes) are AVX2's, which every x86-64 machine the
# suite runs on has: pin it here, before torch is imported, and in every subprocess a test starts.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def micro_cache(tmp_path_factory):
    """One warm-start cache for the whole session: runs with ``MICRO_WARM_START`` build the
    micro model once (the cache is keyed by its config) instead of once per test module."""
    return tmp_path_factory.mktemp("ws-cache")
