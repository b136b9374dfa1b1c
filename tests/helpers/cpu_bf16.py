"""bf16 matrix products on CPUs that have no bf16 GEMM kernel, at fp32 GEMM speed.

torch's CPU bf16 GEMM runs through oneDNN only on AVX-512 (BF16) or AMX machines; elsewhere
(AVX2, the CI machine) it falls back to a scalar loop about 90x slower than fp32's, and the tests
that train the GPU experiments under ``bf16-mixed`` spend their time there. On such a CPU this mode
computes each bf16 ``mm``/``addmm``/``bmm``/``baddbmm`` as an fp32 GEMM of the same bf16 values,
rounded once to bf16: the contract of the native kernel (bf16 operands, fp32 accumulation, one
rounding of the result), so only the summation order differs (``tests/test_cpu_bf16.py``). The
operands, activations and autocast casts stay bf16, so what these tests assert about bf16 compute
(updates kept by fp32 masters, the error against an fp32 run) is what they measure.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})


def has_bf16_gemm() -> bool:
    """Whether torch runs bf16 GEMMs through oneDNN on this CPU (AVX-512 BF16, AMX); a build
    without oneDNN's check counts as without."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Bf16GemmsInFp32(TorchDispatchMode):
    """Every bf16 GEMM as an fp32 GEMM of the same bf16 values, its result rounded to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def bf16_gemms_at_fp32_speed():
    """The mode where the CPU lacks a bf16 GEMM kernel; nothing where it has one."""
    return contextlib.nullcontext() if has_bf16_gemm() else Bf16GemmsInFp32()
