"""FlashAttention's backward for the `triton` set's trainer: causal attention gradients from the contract
forward's output O and log-sum-exp L, never materialising a probability matrix.

Gradients are not under the numerics contract (only the forward's logprobs are); these are FlashAttention
2's recurrence: P = exp(S - L) recomputed per block from the saved L, D = rowsum(dO * O), dV = P^T dO,
dS = P * (dO V^T - D), dK = scale dS^T Q, dQ = scale dS K. Two launches: one program per (query block,
query head) computes D (kept for the second launch) and dQ; one program per (key block, KV head) walks
the query heads of its GQA group and their query blocks for dK and dV, so no two programs write the same
gradient (no atomics). GEMM operands in the activations' dtype (IEEE fp32 for fp32), fp32 accumulation.

Positions follow the forward kernel's rule: ascending and distinct within a row (key j visible to query i
iff positions[j] <= positions[i]), so no key after a query's index is visible to it and each loop stops
(dQ) or starts (dK, dV) at the diagonal block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tonpolicy.kernels.triton import attention as ta
from tonpolicy.kernels.triton.interpreter import use_torch_dot

use_torch_dot()  # in Triton's interpreter (tests on a CPU): tl.dot as a fixed-order tile GEMM

BLOCK_M, BLOCK_N = 64, 64  # queries, keys per block
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    pos_ptr,
    n,
    group,
    s_qb,
    s_qn,
    s_kb,
    s_kn,
    s_lb,
    s_pb,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = h // group
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    d = tl.arange(0, HEAD_DIM)
    qo = b * s_qb + rows[:, None] * s_qn + h * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + qo, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + qo, mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptr + qo, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lrow = b * s_lb + rows * HQ + h
    tl.store(delta_ptr + lrow, delta, mask=row_ok)
    lse = tl.load(lse_ptr + lrow, mask=row_ok, other=0.0)
    qpos = tl.load(pos_ptr + b * s_pb + rows, mask=row_ok, other=-1)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, tl.minimum(n, (pid + 1) * BLOCK_M), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        ko = b * s_kb + cols[:, None] * s_kn + kvh * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + ko, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptr + ko, mask=col_ok[:, None], other=0.0)
        kpos = tl.load(pos_ptr + b * s_pb + cols, mask=col_ok, other=0)
        s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE) * scale
        visible = row_ok[:, None] & col_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, IEEE)
    tl.store(dq_ptr + qo, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    pos_ptr,
    n,
    group,
    s_qb,
    s_qn,
    s_kb,
    s_kn,
    s_lb,
    s_pb,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid, kvh, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    d = tl.arange(0, HEAD_DIM)
    ko = b * s_kb + cols[:, None] * s_kn + kvh * HEAD_DIM + d[None, :]
    k = tl.load(k_ptr + ko, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + ko, mask=col_ok[:, None], other=0.0)
    kpos = tl.load(pos_ptr + b * s_pb + cols, mask=col_ok, other=0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    first = (pid * BLOCK_N // BLOCK_M) * BLOCK_M  # queries before the diagonal block see none of these keys
    for g in range(0, group):
        h = kvh * group + g
        for start in range(first, n, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < n
            qo = b * s_qb + rows[:, None] * s_qn + h * HEAD_DIM + d[None, :]
            q = tl.load(q_ptr + qo, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr + qo, mask=row_ok[:, None], other=0.0)
            lrow = b * s_lb + rows * HQ + h
            lse = tl.load(lse_ptr + lrow, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + lrow, mask=row_ok, other=0.0)
            qpos = tl.load(pos_ptr + b * s_pb + rows, mask=row_ok, other=-1)
            s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE) * scale
            visible = row_ok[:, None] & col_ok[None, :] & (kpos[None, :] <= qpos[:, None])
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            dv = _dot(tl.trans(p.to(do.dtype)), do, dv, IEEE)
            dp = _dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
            ds = p * (dp - delta[:, None])
            dk = _dot(tl.trans(ds.to(q.dtype)), q, dk, IEEE)
    tl.store(dk_ptr + ko, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + ko, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


def forward_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of whole sequences q [B, s, Hq, D], k/v [B, s, Hkv, D], positions [B, s]: out is the
    contract forward's (the kernel's unnormalised state and its own finalize, the bits of
    `attention_batched`), lse = m + log(l) fp32 [B, s, Hq] for the backward (not under the contract)."""
    b, nk = k.shape[:2]
    index = (torch.arange(b, device=q.device) * nk)[:, None] + torch.arange(nk, device=q.device)
    m, den, acc = ta.attention_indexed(
        q,
        positions,
        k.reshape(b * nk, *k.shape[2:]),
        v.reshape(b * nk, *v.shape[2:]),
        index,
        positions,
        torch.full((b,), nk, device=q.device),
        scale,
        partial=True,
    )
    return ta.finalize(den, acc, q.dtype), m + torch.log(den)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes for the shapes of `forward_with_lse`."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv or d & (d - 1) or d < 16:
        raise ValueError(f"need Hq ({hq}) a multiple of Hkv ({hkv}) and a power-of-two head_dim >= 16 ({d})")
    q, k, v, out, grad = (t.contiguous() for t in (q, k, v, out, grad))
    grad = grad.to(q.dtype)
    lse, pos = lse.float().contiguous(), positions.to(torch.int64).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if b * n == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    common = dict(
        HQ=hq, HKV=hkv, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), pos.stride(0))
    _dq_kernel[(triton.cdiv(n, BLOCK_M), hq, b)](
        q, k, v, out, grad, lse, delta, dq, pos, n, hq // hkv, *strides, float(scale), **common
    )
    _dkdv_kernel[(triton.cdiv(n, BLOCK_N), hkv, b)](
        q, k, v, grad, lse, delta, dk, dv, pos, n, hq // hkv, *strides, float(scale), **common
    )
    return dq, dk, dv
