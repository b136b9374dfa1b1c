"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def micro_cache(tmp_path_factory):
    """One warm-start cache for the whole session: runs with ``MICRO_WARM_START`` build the
    micro model once (the cache is keyed by its config) instead of once per test module."""
    return tmp_path_factory.mktemp("ws-cache")
