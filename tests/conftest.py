"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# PyTorch's CPU kernels are chosen per machine (AVX2, AVX-512) and round differently; a warm
# start of many steps carries the difference into every later number. The recorded figures
# (tests/e2e/golden/, resume equality across processes) are AVX2's, which every x86-64 machine the
# suite runs on has: pin it here, before torch is imported, and in every subprocess a test starts.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e/ trains end to end: marked slow, so `make test-fast` leaves it out."""
    e2e = Path(__file__).parent / "e2e"
    for item in items:
        if e2e in item.path.parents:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores for torch (two workers each
    running two threads on two cores would spin against each other)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


@pytest.fixture(scope="session")
def micro_cache(tmp_path_factory):
    """One warm-start cache for the whole session, xdist workers included (the cache is keyed by
    its config and file-locked): runs with ``MICRO_WARM_START`` build the micro model once."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (shared / "ws-cache").mkdir(exist_ok=True)
    return shared / "ws-cache"


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


@pytest.fixture
def cpu_bf16_gemms():
    """bf16 GEMMs at fp32 speed on CPUs without a bf16 GEMM kernel (``tests/helpers/cpu_bf16.py``): for the
    tests that train under ``bf16-mixed`` on the CPU."""
    from cpu_bf16 import bf16_gemms_at_fp32_speed

    with bf16_gemms_at_fp32_speed():
        yield
