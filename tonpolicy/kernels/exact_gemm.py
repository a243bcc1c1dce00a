"""The contract's GEMM: a fixed-point product computed exactly, so its bits are a function of its inputs
alone, on every CPU, BLAS, thread count, row count and tile shape.

Definition (docs/REDUCTION_RULES.md): for C = A @ B over a contraction of length K,
- each row of A (over K) and each column of B (over K) is scaled by a power of two so that its largest
  magnitude lies in [2^(b-1), 2^b), and rounded (half to even) to integers: `b = (53 - ceil(log2 K)) // 2`
  bits, so that every partial sum of K products of such integers is an integer below 2^53;
- an fp32 operand whose elements would keep fewer than 23 of their 24 bits at that `b` is cut into two such
  slices (hi, and the rounded remainder scaled by 2^b): products hi*hi, then hi*lo + lo*hi (one GEMM over
  2K; `b` is chosen for 2K then); lo*lo is not part of the definition;
- the integer GEMMs run in fp64. Every partial sum is an integer of magnitude at most 2^53, which fp64
  holds exactly, so the library's order, blocking, vector width, FMA use and threading cannot change a
  single bit: the product is exact whatever the library does;
- the result is hh + cross * 2^-b in fp64 (one IEEE addition), scaled back by the row's and column's
  powers of two (exact) and rounded once to fp32.
A row's bits depend only on that row and B, a column's only on that column of B (column shards), and
the whole computation only on IEEE arithmetic: the same bits on any machine with IEEE fp64.
`pv_product` folds the per-key scale of v into p (attention's p @ v contracts over keys, so a scale over
the keys of a tile would let a masked key change the visible ones' bits).
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Bits an fp32 operand's slice must keep near its row's max to be taken whole (its significand is 24).
WHOLE_FP32_BITS = 23
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def fixed_point_bits(k: int) -> int:
    """Bits per operand for a contraction of length k: b + b + ceil(log2 k) <= 53."""
    return (53 - math.ceil(math.log2(max(k, 1)))) // 2


def slices_for(dtype: torch.dtype, k: int) -> int:
    """Slices an operand of `dtype` takes in a contraction of length k (bf16/fp16: one; fp32: one while a
    slice keeps 23 bits, else two)."""
    if dtype in _LOW_PRECISION or fixed_point_bits(k) >= WHOLE_FP32_BITS:
        return 1
    return 2


def quantize(a: torch.Tensor, dim: int, bits: int, slices: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Integer slices (fp64) of `a` along `dim` and the per-line power of two 2^(e - bits) that scales slice
    0 back (slice 1 is a further 2^-bits): a ~= (q0 + q1 * 2^-bits) * scale."""
    a64 = a.to(torch.float64)
    amax = a64.abs().amax(dim, keepdim=True)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1); amax = 0 gives e = 0
    up = pow2(bits - e)
    scaled = a64.mul_(up) if a64 is not a else a64 * up  # exact: a power of two
    q0 = torch.round(scaled)
    out = [q0]
    if slices == 2:
        out.append(scaled.sub_(q0).mul_(2.0**bits).round_())  # the remainder is exact, then rounded
    return out, pow2(e - bits)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e in fp64, built from its bit pattern (exact by construction; e within fp64's normal range)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _combine(hh: torch.Tensor, cross: torch.Tensor | None, bits: int, sa: torch.Tensor, sb: torch.Tensor):
    """fp32 of (hh + cross * 2^-bits) * sa * sb: one fp64 addition, exact scalings, one rounding."""
    c = hh if cross is None else hh.add_(cross.mul_(2.0**-bits))
    return c.mul_(sa).mul_(sb).to(torch.float32)


def exact_matmul(
    a: torch.Tensor,
    b_slices: list[torch.Tensor],
    b_scale: torch.Tensor,
    bits: int,
    a_slices: int,
) -> torch.Tensor:
    """fp32 C = A @ B for A [..., M, K] (any float dtype) and B already quantized ([..., K, N] slices and
    its [..., 1, N] column scales, from `quantize(b, -2, bits, ...)`)."""
    qa, sa = quantize(a, -1, bits, a_slices)
    slices = max(a_slices, len(b_slices))
    hh = torch.matmul(qa[0], b_slices[0])
    if slices == 1:
        return _combine(hh, None, bits, sa, sb=b_scale)
    a_lo = qa[1] if a_slices == 2 else torch.zeros_like(qa[0])
    b_lo = b_slices[1] if len(b_slices) == 2 else torch.zeros_like(b_slices[0])
    cross = torch.matmul(torch.cat([qa[0], a_lo], -1), torch.cat([b_lo, b_slices[0]], -2))
    return _combine(hh, cross, bits, sa, sb=b_scale)


def contraction_bits(a_dtype: torch.dtype, b_dtype: torch.dtype, k: int) -> tuple[int, int, int]:
    """(bits, slices of A, slices of B) for a contraction of length k; two slices anywhere make the
    cross GEMM run over 2k, so `bits` is chosen for 2k then."""
    sa, sb = slices_for(a_dtype, k), slices_for(b_dtype, k)
    bits = fixed_point_bits(2 * k if max(sa, sb) == 2 else k)
    return bits, sa, sb


class _TextbookGrad(torch.autograd.Function):
    """C = fn(A, B), a contract product of A @ B, with the plain product's gradient (the rounding to the
    fixed-point grid has none worth the name: only the forward is under the contract)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, fn) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(a, b)
        return fn(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        a, b = ctx.saved_tensors
        g = grad.float()
        da = (g @ b.float().transpose(-1, -2)).to(a.dtype) if ctx.needs_input_grad[0] else None
        db = None
        if ctx.needs_input_grad[1]:
            db = a.float().transpose(-1, -2) @ g
            while db.dim() > b.dim():  # b broadcast over leading dims
                db = db.sum(0)
            db = db.to(b.dtype)
        return da, db, None


def _tracked(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def matmul_as(a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_dtype: torch.dtype) -> torch.Tensor:
    """fp32 C = A @ B (A [..., M, K], B [..., K, N]): the contract GEMM, both operands quantized here;
    `a_dtype`/`b_dtype`: the dtypes the operands' values come from (an upcast bf16 operand is sliced as
    bf16, so fp32 and bf16 callers agree on the slicing). Differentiable (textbook gradient)."""
    if _tracked(a, b):
        return _TextbookGrad.apply(a, b, lambda x, y: matmul_as(x, a_dtype, y, b_dtype))
    k = a.shape[-1]
    bits, sa, sb = contraction_bits(a_dtype, b_dtype, k)
    qb, scale_b = quantize(b, -2, bits, sb)
    return exact_matmul(a, qb, scale_b, bits, sa)


# Quantized weights, kept while the weight's storage and version are unchanged (a trainer step's update
# bumps the version): the quantisation of a weight costs more than a decode step's GEMM.
_weight_cache = WeakIdKeyDictionary()


def quantized_weight(w: torch.Tensor, num_shards: int, x_dtype: torch.dtype):
    """w [N, K] as canonical K-shards for `exact_matmul`: ([C, K/C, N] slices, [C, 1, N] scales, bits,
    slices of x)."""
    n, k = w.shape
    ks = k // num_shards
    bits, sa, sb = contraction_bits(x_dtype, w.dtype, ks)
    key = (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype, num_shards, bits, sb)
    hit = _weight_cache.get(w)
    if hit is not None and hit[0] == key:
        return hit[1]
    wt = w.detach().reshape(n, num_shards, ks).permute(1, 2, 0)  # [C, K/C, N]
    qb, scale = quantize(wt, -2, bits, sb)
    value = ([q.contiguous() for q in qb], scale, bits, sa)
    try:
        _weight_cache[w] = (key, value)
    except TypeError:  # not weak-referenceable: no caching
        pass
    return value


def linear_partials(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
    """fp32 partials [C, ..., N] of x [..., K] @ w[N, K].T over C equal canonical K-shards, each the
    contract GEMM of its shard (its own row and column scales)."""
    *lead, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or k % num_shards:
        raise ValueError(f"K={k} must match weight {tuple(w.shape)} and divide into {num_shards} shards")
    x3 = x.reshape(-1, num_shards, k // num_shards).transpose(0, 1)  # [C, M, K/C]
    if _tracked(x, w):  # no cache: the weight's graph is needed
        out = matmul_as(x3, x.dtype, w.reshape(n, num_shards, k // num_shards).permute(1, 2, 0), w.dtype)
    else:
        qb, scale, bits, sa = quantized_weight(w, num_shards, x.dtype)
        out = exact_matmul(x3, qb, scale, bits, sa)
    return out.view(num_shards, *lead, n)


def pv_product(p: torch.Tensor, v: torch.Tensor, v_dtype: torch.dtype) -> torch.Tensor:
    """fp32 p @ v for p [..., R, T] (fp32 probabilities) and v [..., T, D] (values of `v_dtype`, maybe
    upcast): v is quantized per key (over D), its power of two folded into p (exact), then p per row over
    the keys. A key with p = 0 (masked) adds exactly 0 and changes no scale. Differentiable (textbook)."""
    if _tracked(p, v):
        return _TextbookGrad.apply(p, v, lambda x, y: pv_product(x, y, v_dtype))
    t = p.shape[-1]
    bits, sp, sv = contraction_bits(torch.float32, v_dtype, t)
    qv, v_scale = quantize(v, -1, bits, sv)  # v_scale [..., T, 1]
    pf = p.to(torch.float64) * v_scale.transpose(-1, -2)  # exact: powers of two
    ones = torch.ones((), dtype=torch.float64, device=p.device)
    return exact_matmul(pf, qv, ones, bits, sp)
