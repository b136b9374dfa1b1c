"""Whether vLLM can run here, checked by `make install-gpu` before it installs vLLM: standard
library only, plus ``torch_source.py`` beside it.

A vLLM wheel is compiled for one CUDA version: PyPI's vllm 0.32.0 for CUDA 13.0; vLLM's GitHub
release also carries ``+cuXYZ`` builds (``VLLM_WHEEL=<its URL>``). It needs
- a driver that supports that CUDA major version (``nvidia-smi``'s "CUDA Version"); within a major
  version CUDA's minor-version compatibility lets an older driver run it, with a warning;
- a torch built for the same CUDA major version, since vLLM's kernels link against torch's CUDA
  libraries: torch's CUDA 12.8 build cannot load a CUDA 13 vLLM.
Prints nothing and exits 0 when both hold; else the problem and its fix on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys

from torch_source import _nvidia_smi, driver_cuda

PYPI_VLLM_CUDA = (13, 0)  # PyPI's vllm 0.32.0 wheel (the `vllm` extra)
RELEASES = "https://github.com/vllm-project/vllm/releases"


def wheel_cuda(wheel: str | None) -> tuple[int, int]:
    """The CUDA version a vLLM wheel is built for: its ``+cuXYZ`` tag, else PyPI's build."""
    tag = re.search(r"\+cu(\d+)(\d)\b", wheel or "")
    return (int(tag.group(1)), int(tag.group(2))) if tag else PYPI_VLLM_CUDA


def torch_cuda_of(version: str | None) -> tuple[int, int] | None:
    """``torch.version.cuda`` ("12.8") as a tuple; None for a CPU build."""
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def _v(cuda: tuple[int, int]) -> str:
    return f"{cuda[0]}.{cuda[1]}"


def problems(smi_output: str | None, torch_cuda: str | None, wheel: str | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for installing ``wheel`` (None: PyPI's vllm) beside a torch whose
    ``torch.version.cuda`` is ``torch_cuda``, on the driver ``nvidia-smi`` printed."""
    need = wheel_cuda(wheel)
    build = f"vLLM {'wheel ' + wheel if wheel else '0.32.0 from PyPI'} is built for CUDA {_v(need)}"
    errors, warnings = [], []
    driver = driver_cuda(smi_output)
    if driver is None:
        errors.append(f"no NVIDIA driver answered (nvidia-smi is missing or failed); {build}. Install the driver "
                      f"(one that supports CUDA {_v(need)}) and check nvidia-smi")
    elif driver[0] < need[0]:
        errors.append(f"the NVIDIA driver supports CUDA {_v(driver)}, and {build}: its first engine start would "
                      f"fail. Update the driver to one that supports CUDA {_v(need)}, or install a vLLM 0.32.0 "
                      f"build for CUDA {driver[0]}.x from {RELEASES} (make install-gpu VLLM_WHEEL=<the "
                      f"+cu{driver[0]}x wheel's URL>, with torch for the same CUDA: TORCH_INDEX=https://"
                      f"download.pytorch.org/whl/cu{driver[0]}{driver[1]})")
    elif driver < need:
        warnings.append(f"the NVIDIA driver supports CUDA {_v(driver)}, older than the CUDA {_v(need)} vLLM "
                        f"is built for: it runs through CUDA's minor-version compatibility (no PTX JIT)")
    have = torch_cuda_of(torch_cuda)
    if have is None:
        errors.append(f"torch here is a CPU build; {build}. Reinstall torch for CUDA {need[0]}: rm -rf .venv && "
                      f"make install-gpu")
    elif have[0] != need[0]:
        errors.append(f"torch here is built for CUDA {_v(have)}, and {build}: vLLM's kernels cannot load against "
                      f"another CUDA major version. Install the vLLM 0.32.0 build for CUDA {_v(have)} from "
                      f"{RELEASES} (make install-gpu VLLM_WHEEL=<the +cu{have[0]}{have[1]} wheel's URL>), or torch "
                      f"for CUDA {need[0]} (rm -rf .venv && make install-gpu with TORCH_INDEX unset)")
    return errors, warnings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-cuda", default="", help="torch.version.cuda of the venv's torch ('' for a CPU build)")
    ap.add_argument("--wheel", default="", help="the vLLM wheel make install-gpu installs ('' for PyPI's)")
    args = ap.parse_args(argv)
    errors, warnings = problems(_nvidia_smi(), args.torch_cuda or None, args.wheel or None)
    for line in warnings:
        print(f"[medsrl] warning: {line}", file=sys.stderr)
    for line in errors:
        print(f"[medsrl] {line}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
