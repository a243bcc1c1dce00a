"""Row-local ops of the `triton` kernel set: RMSNorm, SwiGLU, RoPE, logprobs.

Each row is read whole by one program with a block size fixed by the row length alone, so a row's
reduction tree never depends on how many rows the call holds. Arithmetic is fp32 with mul+add
contraction off (every + and * rounds once) and explicitly round-to-nearest `div_rn`/`sqrt_rn`
(Triton's plain `/` and `sqrt` are approximate on GPUs); `exp`/`log` are Triton's (deterministic, not
libm's). One rounding to the activation dtype at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOGPROB_BLOCK = 1024  # vocab chunk per step of the log-softmax row loop
POINTWISE_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, k, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < k
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    var = tl.math.div_rn(tl.sum(x * x, axis=0), k.to(tl.float32))
    y = tl.math.div_rn(x, tl.math.sqrt_rn(var + eps)) * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    c = blk * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    g = tl.load(g_ptr + row * stride_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    y = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    s_xn,
    s_xh,
    s_cn,
    s_on,
    s_oh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    n, hb = tl.program_id(0), tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = (h < heads)[:, None]
    d = tl.arange(0, HALF)[None, :]
    xa = x_ptr + n * s_xn + h[:, None] * s_xh + d
    x1 = tl.load(xa, mask=hok, other=0.0).to(tl.float32)
    x2 = tl.load(xa + HALF, mask=hok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + n * s_cn + d)
    c2 = tl.load(cos_ptr + n * s_cn + HALF + d)
    s1 = tl.load(sin_ptr + n * s_cn + d)
    s2 = tl.load(sin_ptr + n * s_cn + HALF + d)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    oa = out_ptr + n * s_on + h[:, None] * s_oh + d
    tl.store(oa, (x1 * c1 + (-x2) * s1).to(out_ptr.dtype.element_ty), mask=hok)
    tl.store(oa + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=hok)


@triton.jit
def _logprob_kernel(logits_ptr, tok_ptr, out_ptr, vocab, stride_r, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride_r
    c = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        x = tl.load(base + v0 + c, mask=v0 + c < vocab, other=float("-inf"))
        run_max = tl.maximum(run_max, tl.math.div_rn(x, temperature))
    mx = tl.max(run_max, axis=0)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        x = tl.load(base + v0 + c, mask=v0 + c < vocab, other=float("-inf"))
        run_sum += tl.exp(tl.math.div_rn(x, temperature) - mx)
    tok = tl.load(tok_ptr + row)
    xt = tl.math.div_rn(tl.load(base + tok), temperature)
    tl.store(out_ptr + row, (xt - mx) - tl.log(tl.sum(run_sum, axis=0)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D [rows, last] view (a copy only if the layout cannot be viewed so; copies change no bits)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        k = x2.shape[1]
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight.contiguous(),
            out,
            k,
            x2.stride(0),
            out.stride(0),
            float(eps),
            BLOCK=triton.next_power_of_2(k),
            enable_fp_fusion=False,
        )
    return out.view(x.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    rows, n = g2.shape
    if rows:
        _swiglu_kernel[(rows, triton.cdiv(n, POINTWISE_BLOCK))](
            g2,
            u2,
            out,
            n,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            BLOCK=POINTWISE_BLOCK,
            enable_fp_fusion=False,
        )
    return out.view(gate.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] (D contiguous), fp32 cos/sin [N, D] -> x.dtype."""
    n, h, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.to(x.device, torch.float32).contiguous(), sin.to(x.device, torch.float32).contiguous()
    out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
    if n * h:
        block_h = min(16, triton.next_power_of_2(h))
        _rope_kernel[(n, triton.cdiv(h, block_h))](
            x,
            cos,
            sin,
            out,
            h,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            out.stride(0),
            out.stride(1),
            HALF=d // 2,
            BLOCK_H=block_h,
            enable_fp_fusion=False,
        )
    return out


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """fp32 log_softmax(logits[..., :vocab_size] / temperature) at `tokens`."""
    x2 = _rows(logits.float())
    t = tokens.reshape(-1).to(device=logits.device, dtype=torch.int64).contiguous()
    out = torch.empty(t.shape[0], dtype=torch.float32, device=logits.device)
    if t.numel():
        _logprob_kernel[(t.shape[0],)](
            x2,
            t,
            out,
            vocab_size,
            x2.stride(0),
            float(temperature),
            BLOCK=LOGPROB_BLOCK,
            enable_fp_fusion=False,
        )
    return out.view(tokens.shape)
