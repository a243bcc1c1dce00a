"""Invariant GEMM of the `triton` kernel set: canonical K-shard partials on fixed tiles.

Every output tile [BLOCK_M, BLOCK_N] belongs to one program, which walks its K range in BLOCK_K steps
in a fixed order with `tl.dot` (bf16/fp16 operands on tensor cores, fp32 products and accumulation;
fp32 operands as IEEE fp32, never tf32). One compiled configuration serves every call, so a row's
bits cannot depend on M, on the other rows, on its position in the tile, or on which columns (N-shard)
the call computes. K is cut into `C` canonical shards whose fp32 partials are added in the contract's
fixed order; a TP rank computes its shards' partials, the ranks' partials are
gathered in rank order and folded the same way, so TP 1, 2 and 4 give the same bits.

The shards are combined left to right, ((p0 + p1) + p2) + p3 (not the `invariant` set's pairwise tree):
the fused GEMM then keeps two accumulators live, not three. `linear` folds inside the GEMM (same fp32
additions in the same order as partials + `fold`); for short inputs (decode) it launches one program per
(tile, shard) and folds with a second kernel, which fills the GPU with C times more programs. Both
routes give identical bits; the choice only moves work between programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tonpolicy.kernels.triton.interpreter import use_torch_dot

use_torch_dot()  # in Triton's interpreter (tests on a CPU): tl.dot as a fixed-order tile GEMM

# The one configuration (no autotuning: a different tile shape is a different contract).
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
# On an H200 every tile shape tried gave the same bits (experiments/results/gpu_triton_h200.json,
# "tune"); this one was the fastest in prefill. The shape stays fixed all the same: the contract is
# what was proven, not what was observed.
NUM_WARPS, NUM_STAGES = 8, 4
# Below this many row tiles the per-(tile, shard) route is used (same bits, more parallelism).
SPLIT_BELOW_ROW_TILES = 4


@triton.jit
def _shard_acc(
    x_ptr,
    w_ptr,
    rm,
    rn,
    M,
    N,
    k_lo,
    k_shard,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] = x[rm, k_lo:k_lo+k_shard] @ w[rn, same].T, K walked in BLOCK_K steps."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_shard, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < k_shard
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :],
            mask=(rm[:, None] < M) & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + (k_lo + rk)[:, None],
            mask=(rn[None, :] < N) & kmask[:, None],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _partials_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    k_shard,
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program per (row tile, column tile, shard): out[s] = fp32 partial of shard s."""
    pm, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _shard_acc(
        x_ptr,
        w_ptr,
        rm,
        rn,
        M,
        N,
        s * k_shard,
        k_shard,
        stride_xm,
        stride_wn,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        IEEE,
    )
    tl.store(
        out_ptr + s * stride_os + rm[:, None] * stride_om + rn[None, :],
        acc,
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit(do_not_specialize=["M"])
def _fused_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    k_shard,
    stride_xm,
    stride_wn,
    stride_om,
    shards,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """All partials of one output tile, folded left to right in shard order in registers."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    y = _shard_acc(x_ptr, w_ptr, rm, rn, M, N, 0, k_shard, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    for s in range(1, shards):
        y = y + _shard_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            M,
            N,
            s * k_shard,
            k_shard,
            stride_xm,
            stride_wn,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            IEEE,
        )
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _fold_kernel(p_ptr, out_ptr, numel, stride_s, shards, BLOCK: tl.constexpr):
    """out = ((p[0] + p[1]) + p[2]) + ... elementwise, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    y = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in range(1, shards):
        y = y + tl.load(p_ptr + s * stride_s + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_opts() -> dict:
    # No mul+add contraction into FMA: every + and * rounds once, as in the reference formulas.
    return {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "enable_fp_fusion": False}


def _prepare(x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    k = x.shape[-1]
    if weight.shape[1] != k or k % num_shards:
        raise ValueError(f"K={k} must match weight {tuple(weight.shape)} and divide into {num_shards} shards")
    if x.dtype != weight.dtype:
        raise TypeError(f"activations ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    return x.reshape(-1, k).contiguous(), weight.contiguous(), k // num_shards


def partials(x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
    """fp32 partials [num_shards, ..., N] of x [..., K] @ weight[N, K].T over equal K shards."""
    x2, w, ks = _prepare(x, weight, num_shards)
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty(num_shards, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), num_shards)
        _partials_kernel[grid](
            x2,
            w,
            out,
            m,
            n,
            ks,
            x2.stride(0),
            w.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            IEEE=x2.dtype == torch.float32,
            **_launch_opts(),
        )
    return out.view(num_shards, *x.shape[:-1], n)


def fold(stack: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Left-to-right sum over dim 0 of an fp32 stack [C, ...], cast to out_dtype."""
    c = stack.shape[0]
    stack = stack.contiguous()
    out = torch.empty(stack.shape[1:], dtype=out_dtype, device=stack.device)
    numel = out.numel()
    if numel:
        block = 1024
        _fold_kernel[(triton.cdiv(numel, block),)](
            stack, out, numel, stack.stride(0), c, BLOCK=block, enable_fp_fusion=False
        )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, num_shards: int, out_dtype: torch.dtype) -> torch.Tensor:
    """fold(partials(x, weight, num_shards)) in out_dtype, fused when the GPU is full anyway."""
    x2, w, ks = _prepare(x, weight, num_shards)
    m, n = x2.shape[0], w.shape[0]
    if triton.cdiv(m, BLOCK_M) < SPLIT_BELOW_ROW_TILES:
        return fold(partials(x2, w, num_shards), out_dtype).view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _fused_kernel[grid](
        x2,
        w,
        out,
        m,
        n,
        ks,
        x2.stride(0),
        w.stride(0),
        out.stride(0),
        num_shards,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        IEEE=x2.dtype == torch.float32,
        **_launch_opts(),
    )
    return out.view(*x.shape[:-1], n)
