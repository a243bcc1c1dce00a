"""Fused backward of the `triton` set's row-local ops for the trainer: one launch per op where the textbook
backward in torch takes a dozen elementwise launches.

Gradients are not under the numerics contract (only the forward's logprobs are); these are the textbook
formulas of `trainer.kernel_autograd` in fp32, each row read once. RMSNorm: r = 1 / sqrt(mean(x^2) + eps),
dx = (g w - x r mean(g w x r)) r; dw = sum over rows of g x r, summed per block of ROWS rows in the
kernel and over the blocks by torch. SwiGLU: s = 1 / (1 + exp(-a)), d_up = g a s,
d_gate = g u s (1 + a (1 - s)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per RMSNorm program: its dw partial covers them
POINTWISE_BLOCK = 1024


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, rows, k, s_x, s_g, s_dx, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < k
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    kf = k.to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        m = ok & (row < rows)  # rows past the end read zeros and add nothing to dw
        x = tl.load(x_ptr + row * s_x + c, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * s_g + c, mask=m, other=0.0).to(tl.float32)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(x * x, axis=0), kf) + eps))
        xr = x * r
        dw += g * xr
        u = g * w
        dx = (u - xr * tl.math.div_rn(tl.sum(u * xr, axis=0), kf)) * r
        tl.store(dx_ptr + row * s_dx + c, dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid * BLOCK + c, dw, mask=ok)


@triton.jit
def _swiglu_bwd_kernel(
    a_ptr, u_ptr, g_ptr, da_ptr, du_ptr, n, s_a, s_u, s_g, s_da, s_du, BLOCK: tl.constexpr
):  # fmt: skip
    row, blk = tl.program_id(0), tl.program_id(1)
    c = blk * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    a = tl.load(a_ptr + row * s_a + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * s_u + c, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * s_g + c, mask=ok, other=0.0).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-a))
    tl.store(du_ptr + row * s_du + c, (g * a * s).to(du_ptr.dtype.element_ty), mask=ok)
    tl.store(da_ptr + row * s_da + c, (g * u * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, last] view with a unit last stride (copied only if needed)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor, need_dw: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x.dtype, dw in weight.dtype or None) of y = rms_norm(x, weight, eps) for the cotangent grad."""
    x2, g2 = _rows(x), _rows(grad)
    rows, k = x2.shape
    dx = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    progs = triton.cdiv(rows, ROWS)
    block = triton.next_power_of_2(k)
    dw_parts = torch.empty(progs, block, dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_bwd_kernel[(progs,)](
            x2, weight, g2, dx, dw_parts, rows, k, x2.stride(0), g2.stride(0), dx.stride(0), float(eps),
            ROWS=ROWS, BLOCK=block, enable_fp_fusion=False,
        )  # fmt: skip
    dw = dw_parts[:, :k].sum(0).to(weight.dtype) if need_dw else None
    return dx.view(x.shape), dw


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of y = silu(gate) * up for the cotangent grad, in the inputs' dtypes."""
    a2, u2, g2 = _rows(gate), _rows(up), _rows(grad)
    rows, n = a2.shape
    da = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    du = torch.empty(rows, n, dtype=up.dtype, device=up.device)
    if rows:
        _swiglu_bwd_kernel[(rows, triton.cdiv(n, POINTWISE_BLOCK))](
            a2, u2, g2, da, du, n, a2.stride(0), u2.stride(0), g2.stride(0), da.stride(0), du.stride(0),
            BLOCK=POINTWISE_BLOCK, enable_fp_fusion=False,
        )  # fmt: skip
    return da.view(gate.shape), du.view(up.shape)
