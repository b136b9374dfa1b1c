"""`make install-gpu`'s check before it installs vLLM (``scripts/cuda_match.py``): the driver's
CUDA (a faked ``nvidia-smi``) and torch's CUDA against the vLLM build's."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from run_helpers import ROOT

SCRIPTS = ROOT / "scripts"
SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: {cuda}     |
+-----------------------------------------------------------------------------------------+"""
CU128 = "https://github.com/vllm-project/vllm/releases/download/v0.32.0/vllm-0.32.0+cu128-cp38-abi3-manylinux_2_35_x86_64.whl"


def _cuda_match():
    sys.path.insert(0, str(SCRIPTS))  # it imports torch_source beside it
    try:
        spec = importlib.util.spec_from_file_location("cuda_match", SCRIPTS / "cuda_match.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def test_the_wheel_names_its_cuda_and_pypis_is_cuda_13():
    cm = _cuda_match()
    assert cm.wheel_cuda(None) == (13, 0) and cm.wheel_cuda(CU128) == (12, 8)
    assert cm.wheel_cuda("vllm-0.32.0+cu130-cp38-abi3.whl") == (13, 0)
    assert cm.torch_cuda_of("12.8") == (12, 8) and cm.torch_cuda_of(None) is None


def test_matching_driver_and_torch_pass():
    cm = _cuda_match()
    assert cm.problems(SMI.format(cuda="13.0"), "13.0", None) == ([], [])
    assert cm.problems(SMI.format(cuda="13.1"), "13.0", None) == ([], [])
    assert cm.problems(SMI.format(cuda="12.8"), "12.8", CU128) == ([], [])


def test_an_older_driver_fails_naming_a_driver_or_a_build_for_its_cuda():
    cm = _cuda_match()
    errors, _ = cm.problems(SMI.format(cuda="12.8"), "13.0", None)
    (error,) = errors
    assert "supports CUDA 12.8" in error and "built for CUDA 13.0" in error
    assert "Update the driver" in error and "VLLM_WHEEL=" in error and "whl/cu128" in error


def test_torch_of_another_cuda_major_fails_naming_both_fixes():
    """The documented TORCH_INDEX=.../cu128 escape with PyPI's CUDA 13 vLLM: caught before installing."""
    cm = _cuda_match()
    (error,) = cm.problems(SMI.format(cuda="13.0"), "12.8", None)[0]
    assert "torch here is built for CUDA 12.8" in error and "+cu128" in error and "TORCH_INDEX unset" in error
    (error,) = cm.problems(SMI.format(cuda="13.0"), None, None)[0]
    assert "CPU build" in error


def test_no_driver_fails_and_a_minor_version_behind_warns():
    cm = _cuda_match()
    assert "no NVIDIA driver" in cm.problems(None, "13.0", None)[0][0]
    errors, warnings = cm.problems(SMI.format(cuda="12.6"), "12.8", CU128)
    assert errors == [] and "minor-version compatibility" in warnings[0]


def test_the_script_reads_a_faked_nvidia_smi_and_exits_2_with_the_fix(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncat <<'SMI'\n{SMI.format(cuda='12.8')}\nSMI\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    run = [sys.executable, str(SCRIPTS / "cuda_match.py")]
    old = subprocess.run([*run, "--torch-cuda", "13.0"], capture_output=True, text=True, env=env)
    assert old.returncode == 2 and "supports CUDA 12.8" in old.stderr
    ok = subprocess.run([*run, "--torch-cuda", "12.8", "--wheel", CU128], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and ok.stderr == ""
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ninstall-gpu:", 1)[1].split("\n\n", 1)[0]
    assert recipe.index("scripts/cuda_match.py") < recipe.index('-e ".[vllm]"')  # checked before installing
