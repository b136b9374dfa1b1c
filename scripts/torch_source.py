"""Which torch build `make install` asks pip for, from this machine's hardware: standard library
only (it runs before anything is installed). Prints the pip arguments on one line, or says on
stderr exactly what to set and exits 2.

- ``TORCH_INDEX`` set: that index (a cluster's own CUDA build, a mirror).
- Linux x86-64 without a working NVIDIA driver: the CPU build (``+cpu``) from PyTorch's CPU index,
  not PyPI's default Linux wheel, which is a CUDA build of several GB.
- An NVIDIA driver: PyPI's build (CUDA 13) when the driver supports CUDA 13; else no guess is
  made, since a build newer than the driver installs but cannot see the GPU: the message names the
  index to set.
- Elsewhere (macOS, Linux on ARM): PyPI's build, which is the CPU (or MPS) one there.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_CUDA = (13, 0)  # the CUDA version of PyPI's Linux wheels of the torch this project pins


def driver_cuda(smi_output: str | None) -> tuple[int, int] | None:
    """The highest CUDA version the NVIDIA driver supports, from ``nvidia-smi``'s header; None
    without a driver (no nvidia-smi, or it failed)."""
    if not smi_output:
        return None
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi_output)
    return (int(found.group(1)), int(found.group(2))) if found else None


def torch_source(version: str, smi_output: str | None, system: str, machine: str,
                 index: str | None = None) -> list[str]:
    """The pip arguments that install torch ``version`` on this machine (see the module docstring);
    raises ``SystemExit`` with the message when it cannot choose."""
    if index:
        return [f"torch=={version}", "--index-url", index]
    cuda = driver_cuda(smi_output)
    if cuda is None:
        if system == "Linux" and machine in ("x86_64", "AMD64"):
            return [f"torch=={version}+cpu", "--index-url", CPU_INDEX]
        return [f"torch=={version}"]
    if cuda >= PYPI_CUDA:
        return [f"torch=={version}"]
    have, need = ".".join(map(str, cuda)), ".".join(map(str, PYPI_CUDA))
    raise SystemExit(
        f"[medsrl] the NVIDIA driver supports CUDA {have}; PyPI's torch {version} is built for CUDA {need} "
        f"and would not see the GPU. Update the driver, or install a build for a CUDA version the driver "
        f"supports from PyTorch's index, e.g.: make install TORCH_INDEX=https://download.pytorch.org/whl/cu"
        f"{cuda[0]}{cuda[1]} (see https://pytorch.org/get-started/previous-versions/ for the builds of "
        f"torch {version})")


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: torch_source.py <torch version>", file=sys.stderr)
        return 2
    try:
        args = torch_source(argv[0], _nvidia_smi(), platform.system(), platform.machine(),
                            os.environ.get("TORCH_INDEX") or None)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
