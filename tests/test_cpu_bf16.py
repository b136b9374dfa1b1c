"""``cpu_bf16.Bf16GemmsInFp32``: bf16 GEMMs as fp32 GEMMs of the same bf16 values, one rounding of
the result, which is the native bf16 kernel's contract (fp32 accumulation): the two agree but for
the summation order, and nothing else changes."""

from __future__ import annotations

import pytest
import torch

from cpu_bf16 import Bf16GemmsInFp32

torch.manual_seed(0)
A, B, C = torch.randn(3, 48, 40), torch.randn(3, 40, 24), torch.randn(3, 48, 24)


def _ops():
    return {
        "mm": lambda a, b, c: a[0] @ b[0],
        "addmm": lambda a, b, c: torch.addmm(c[0], a[0], b[0], beta=0.5, alpha=2.0),
        "bmm": lambda a, b, c: torch.bmm(a, b),
        "baddbmm": lambda a, b, c: torch.baddbmm(c, a, b),
        "linear": lambda a, b, c: torch.nn.functional.linear(a[0], b[0].T, c[0, 0]),
    }


@pytest.mark.parametrize("op", list(_ops()))
def test_a_bf16_gemm_is_the_native_kernels_result_up_to_summation_order(op):
    f = _ops()[op]
    a, b, c = A.bfloat16(), B.bfloat16(), C.bfloat16()
    native = f(a, b, c)
    with Bf16GemmsInFp32():
        emulated = f(a, b, c)
    assert emulated.dtype == torch.bfloat16 and emulated.shape == native.shape
    exact = f(a.double(), b.double(), c.double())  # the same bf16 values, no rounding in the sum
    assert (emulated == exact.bfloat16()).float().mean() > 0.99
    # one rounding of an fp32 sum either way: at most one bf16 step apart
    step = exact.abs().float().clamp_min(1e-3) * 2.0 ** -7
    assert ((emulated.float() - native.float()).abs() <= step).all()


def test_fp32_gemms_and_bf16_autograd_pass_through():
    a, b = A[0].clone().requires_grad_(), B[0]
    with Bf16GemmsInFp32():
        assert torch.equal(a @ b, A[0] @ B[0])  # fp32 untouched
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = a @ b
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and a.grad.dtype == torch.float32
    ref = A[0].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (ref @ b).float().sum().backward()
    torch.testing.assert_close(a.grad, ref.grad, atol=0.05, rtol=2.0 ** -7)
