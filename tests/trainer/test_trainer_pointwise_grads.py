"""The trainer's RMSNorm and SwiGLU backward (written out, `kernel_autograd`) against float64 autograd of
the same formulas: fp32 to fp32 rounding, bf16 to bf16 rounding; the forward is the kernel's own bits."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.kernels import get_kernels
from tonpolicy.trainer.kernel_autograd import KernelRMSNorm, KernelSwiGLU

CASES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def _close(a: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    return bool((a.double() - ref).abs().max() <= tol * ref.abs().max())


@pytest.mark.parametrize(("dtype", "tol"), CASES)
def test_rms_norm_grads_equal_autograd(dtype: torch.dtype, tol: float) -> None:
    kern = get_kernels("ordered")
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 3).to(dtype).requires_grad_()
    w = (torch.rand(64) + 0.5).to(dtype).requires_grad_()
    g = torch.randn(3, 5, 64).to(dtype)
    y = KernelRMSNorm.apply(x, w, 1e-6, kern.rms_norm)
    with torch.no_grad():
        assert torch.equal(y, kern.rms_norm(x, w, 1e-6))  # the forward is the kernel's
    y.backward(g)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref = xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * wd
    ref.backward(g.double())
    assert _close(x.grad, xd.grad, tol) and _close(w.grad, wd.grad, tol)
    assert not _close(x.grad, xd.grad * 1.01, tol / 10)  # the check can fail: a 1% error is seen


@pytest.mark.parametrize(("dtype", "tol"), CASES)
def test_swiglu_grads_equal_autograd(dtype: torch.dtype, tol: float) -> None:
    kern = get_kernels("ordered")
    torch.manual_seed(1)
    gate, up = ((torch.randn(2, 7, 48) * 4).to(dtype).requires_grad_() for _ in range(2))
    g = torch.randn(2, 7, 48).to(dtype)
    y = KernelSwiGLU.apply(gate, up, kern.swiglu)
    with torch.no_grad():
        assert torch.equal(y, kern.swiglu(gate, up))
    y.backward(g)
    gd, ud = (t.detach().double().requires_grad_() for t in (gate, up))
    (torch.nn.functional.silu(gd) * ud).backward(g.double())
    assert _close(gate.grad, gd.grad, tol) and _close(up.grad, ud.grad, tol)
    assert not _close(up.grad, ud.grad * 1.01, tol / 10)
