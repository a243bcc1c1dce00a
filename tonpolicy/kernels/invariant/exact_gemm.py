"""The contract's GEMM: a fixed-point product computed exactly, so its bits are a function of its inputs
alone, on every CPU, BLAS, thread count, row count and tile shape.

Definition (docs/REDUCTION_RULES.md), for C = A @ B over a contraction of length K, L = ceil(log2 K):
- each row of A (over K) and each column of B (over K) is scaled by a power of two so that its largest
  magnitude lies in [2^(b-1), 2^b), and rounded (half to even) to integers of b bits: A to `bits_a`, B to
  `bits_b`, with bits_a + bits_b + L <= 53, so every partial sum of K products is an integer of at most
  2^53 in magnitude, which fp64 holds exactly;
- both operands bf16/fp16: bits_a = bits_b = (53 - L) // 2 (their 8 or 11 significant bits are whole for
  elements within 2^-12 of their line's max at K <= 8192). Otherwise B takes bits_b = min(24, 41 - L) and
  A bits_a = 53 - L - bits_b; an fp32 A that would keep fewer than 23 bits is cut into two slices (hi,
  and the rounded remainder scaled by 2^bits_a), each multiplied by B; hi * B + (lo * B) * 2^-bits_a is one
  fp64 addition;
- the integer GEMMs run in fp64: whatever the library's order, blocking, vector width, FMA use or threads,
  every partial sum is exact, so not a single bit can change;
- the result is scaled back by the row's and the column's powers of two (exact) and rounded once to fp32.
A row's bits depend only on that row and B, a column's only on that column of B (column shards), and
the whole computation only on IEEE arithmetic: the same bits on any machine with IEEE fp64.
`pv_product` folds the per-key scale of v into p (attention's p @ v contracts over keys, so a scale over
the keys of a tile would let a masked key change the visible ones' bits).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tonpolicy.kernels import weight_cache
from tonpolicy.kernels.invariant import exact_gemv
from tonpolicy.kernels.invariant.exact_bits import contraction_bits, pow2

__all__ = ["contraction_bits", "pow2"]  # re-exported: the GEMM's definition reads as one module


def quantize(a: torch.Tensor, dim: int, bits: int, slices: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer slices of `a` along `dim` (fp64, stacked on a new dim -3 when two) and the per-line power of
    two 2^(e - bits) that scales slice 0 back (slice 1 is a further 2^-bits)."""
    a64 = a.to(torch.float64)
    amax = a64.abs().amax(dim, keepdim=True)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1); amax = 0 gives e = 0
    scaled = a64.mul_(pow2(bits - e)) if a64 is not a else a64 * pow2(bits - e)  # exact: a power of two
    q0 = torch.round(scaled)
    if slices == 1:
        return q0, pow2(e - bits)
    lo = scaled.sub_(q0).mul_(2.0**bits).round_()  # the remainder is exact, then rounded
    return torch.stack([q0, lo], dim=-3), pow2(e - bits)


def exact_matmul(a: torch.Tensor, qb: torch.Tensor, scale_b: torch.Tensor, bits_a: int, slices_a: int) -> torch.Tensor:
    """fp32 C = A @ B for A [..., M, K] (any float dtype) and B already quantized (`quantize(b, -2,
    bits_b)`: integers [..., K, N] and column scales [..., 1, N])."""
    qa, scale_a = quantize(a, -1, bits_a, slices_a)
    if slices_a == 1:
        c = torch.matmul(qa, qb)
    else:  # both slices in one GEMM of 2M rows: one pass over B
        m = a.shape[-2]
        both = torch.matmul(qa.flatten(-3, -2), qb)
        c = both[..., :m, :].add_(both[..., m:, :].mul_(2.0**-bits_a))
    return c.mul_(scale_a).mul_(scale_b).to(torch.float32)


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


def matmul_as(
    a: torch.Tensor, a_dtype: torch.dtype, b: torch.Tensor, b_dtype: torch.dtype, short_k: bool = False
) -> torch.Tensor:
    """fp32 C = A @ B (A [..., M, K], B [..., K, N]): the contract GEMM, both operands quantized here;
    `a_dtype`/`b_dtype`: the dtypes the operands' values come from (an upcast bf16 operand is quantized
    as bf16, so fp32 and bf16 callers agree). `short_k`: a short contraction (attention's scores over the
    head dim), which the compiled product takes at any row count. Differentiable (textbook gradient)."""
    if _tracked(a, b):
        return _TextbookGrad.apply(a, b, lambda x, y: matmul_as(x, a_dtype, y, b_dtype, short_k))
    bits_a, bits_b, slices_a = contraction_bits(a_dtype, b_dtype, a.shape[-1])
    out = exact_gemv.bmm(a, b, bits_a, bits_b, slices_a, per_row_b=False, any_rows=short_k)  # same bits
    if out is not None:
        return out
    qb, scale_b = quantize(b, -2, bits_b)
    return exact_matmul(a, qb, scale_b, bits_a, slices_a)


# Quantized weights, kept while the weight's storage, version and the weights generation
# (tonpolicy.kernels.weight_cache) are unchanged: the quantisation of a weight costs more than a decode
# step's GEMM.
_weight_cache = WeakIdKeyDictionary()


def quantized_weight(w: torch.Tensor, num_shards: int, x_dtype: torch.dtype):
    """w [N, K] as canonical K-shards for `exact_matmul`: ([C, K/C, N] integers, [C, 1, N] scales, bits of
    x, slices of x)."""
    n, k = w.shape
    ks = k // num_shards
    bits_a, bits_b, slices_a = contraction_bits(x_dtype, w.dtype, ks)
    key = (weight_cache.generation(), w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype, num_shards, bits_b)
    hit = _weight_cache.get(w)
    if hit is not None and hit[0] == key:
        qb, scale = hit[1]
    else:
        wt = w.detach().reshape(n, num_shards, ks).permute(1, 2, 0)  # [C, K/C, N]
        qb, scale = quantize(wt, -2, bits_b)
        qb = qb.contiguous()
        try:
            _weight_cache[w] = (key, (qb, scale))
        except TypeError:  # not weak-referenceable: no caching
            pass
    return qb, scale, bits_a, slices_a


def linear_partials(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
    """fp32 partials [C, ..., N] of x [..., K] @ w[N, K].T over C equal canonical K-shards, each the
    contract GEMM of its shard (its own row and column scales). Up to `exact_gemv.MAX_ROWS` untracked
    rows take the compiled GEMV, which reads w in its own dtype (the same bits by construction)."""
    *lead, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or k % num_shards:
        raise ValueError(f"K={k} must match weight {tuple(w.shape)} and divide into {num_shards} shards")
    if not _tracked(x, w) and x.numel() <= exact_gemv.MAX_ROWS * k:  # one stream's decode: the same bits
        out = exact_gemv.linear_partials(x.reshape(-1, k), w, num_shards)
        if out is not None:
            return out.view(num_shards, *lead, n)
    x3 = x.reshape(-1, num_shards, k // num_shards).transpose(0, 1)  # [C, M, K/C]
    if _tracked(x, w):  # no cache: the weight's graph is needed
        out = matmul_as(x3, x.dtype, w.reshape(n, num_shards, k // num_shards).permute(1, 2, 0), w.dtype)
    else:
        qb, scale, bits_a, slices_a = quantized_weight(w, num_shards, x.dtype)
        out = exact_gemv.linear_rows(x.reshape(-1, k), qb, scale, num_shards, bits_a, slices_a)  # the same bits
        if out is None:
            out = exact_matmul(x3, qb, scale, bits_a, slices_a)
    return out.view(num_shards, *lead, n)


def pv_product(p: torch.Tensor, v: torch.Tensor, v_dtype: torch.dtype) -> torch.Tensor:
    """fp32 p @ v for p [..., R, T] (fp32 probabilities) and v [..., T, D] (values of `v_dtype`, maybe
    upcast): v is quantized per key (over D), its power of two folded into p (exact), then p per row over
    the keys. A key with p = 0 (masked) adds exactly 0 and changes no scale. Differentiable (textbook)."""
    if _tracked(p, v):
        return _TextbookGrad.apply(p, v, lambda x, y: pv_product(x, y, v_dtype))
    bits_p, bits_v, slices_p = contraction_bits(torch.float32, v_dtype, p.shape[-1])
    out = exact_gemv.bmm(p, v, bits_p, bits_v, slices_p, per_row_b=True, any_rows=True)  # over a key tile
    if out is not None:
        return out
    qv, v_scale = quantize(v, -1, bits_v)  # per key: v_scale [..., T, 1]
    pf = p.to(torch.float64) * v_scale.transpose(-1, -2)  # exact: powers of two
    return exact_matmul(pf, qv, torch.ones((), dtype=torch.float64), bits_p, slices_p)
