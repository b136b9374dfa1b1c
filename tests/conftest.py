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


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with every file it keeps in ``tmp_path`` and no way to the network:
    skips the test when ``wandb`` (the ``wandb`` extra) is not installed."""
    pytest.importorskip("wandb", reason='wandb is not installed (the wandb extra: pip install -e ".[wandb]")')
    home = tmp_path / "wandb-home"
    for var, sub in [("WANDB_DIR", "dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")]:
        (home / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # if anything tried the network: refused at once
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield home
    import wandb

    if wandb.run is not None:  # a test that failed mid-run: never leave a run for the next test
        wandb.finish(exit_code=1)
