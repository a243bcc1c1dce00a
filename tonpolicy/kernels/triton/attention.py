"""Split-KV causal attention of the `triton` kernel set: one kernel for prefill, chunked prefill, decode,
the trainer's forward and ring-CP tiles.

A program owns BLOCK_M rows: up to BLOCK_M // G queries of one sequence times the G query heads that
share a KV head (GQA heads packed as rows; the rest padded). Keys are read through an index table (a
token row per key), so contiguous keys, the embedded engine's KV pool and SGLang's paged pool all go
through the same code. Key tiles hold TILE keys aligned to key index 0 (= position 0) and are visited
in key order; per tile: s = (q . k) * scale (fp32 accumulation), masked keys -inf, m_t = rowmax,
p = exp(s - m_t), l_t = rowsum(p), acc_t = p @ v (p rounded to the KV dtype, fp32 accumulation), then
merged into the running state with the one `merge` formula below (also `merge_kernel`, which ring CP
uses to fold tiles that arrive from other ranks). A tile no query of the block can see is skipped,
and a fully masked tile is an exact no-op for a row, so a query's bits never depend on the other
queries of its block, on how the sequence was chunked, or on how many keys the cache holds beyond it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tonpolicy.kernels import TRITON_ATTENTION_TILE as TILE
from tonpolicy.kernels.triton.interpreter import use_torch_dot

use_torch_dot()  # in Triton's interpreter (tests on a CPU): tl.dot as a fixed-order tile GEMM

BLOCK_M = 64
# 3 pipeline stages: faster than 2 on an H200 at prefill and decode, with the same bits
# (experiments/results/gpu_triton_h200.json, "tune").
NUM_WARPS, NUM_STAGES = 4, 3
QUERY_PAD_POS = tl.constexpr(-1)


@triton.jit
def _merge(m, den, acc, mt, lt, at):
    """The one merge formula: (m, l, acc) covers keys before (mt, lt, at)."""
    mn = tl.maximum(m, mt)
    ms = tl.where(mn == float("-inf"), 0.0, mn)
    ca = tl.exp(m - ms)
    cb = tl.exp(mt - ms)
    return mn, den * ca + lt * cb, acc * ca[:, None] + at * cb[:, None]


@triton.jit(do_not_specialize=["nq", "k_rows"])
def _attention_kernel(
    q_ptr,
    qpos_ptr,
    k_ptr,
    v_ptr,
    kidx_ptr,
    kpos_ptr,
    nkeys_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    scale,
    nq,
    k_rows,
    group,
    s_qb,
    s_qn,
    s_qh,
    s_pb,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_ib,
    s_kpb,
    s_ob,
    s_on,
    s_oh,
    s_mb,
    s_mn,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    PARTIAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_q, kvh, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    per_block = BLOCK_M // group
    qi = pid_q * per_block + rows // group
    hi = kvh * group + rows % group
    row_ok = (rows < per_block * group) & (qi < nq)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * s_qb + qi[:, None] * s_qn + hi[:, None] * s_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    qpos = tl.load(qpos_ptr + b * s_pb + qi, mask=row_ok, other=QUERY_PAD_POS)
    last = tl.max(qpos, axis=0)
    nk = tl.load(nkeys_ptr + b)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    # Key positions are ascending, distinct and >= 0, so key j sits at position >= j: tiles past the
    # block's last query position hold no visible key and are skipped (an exact no-op). A plain loop
    # bound, not a branch per tile, keeps the loop software-pipelined.
    n_tiles = tl.minimum(tl.cdiv(nk, TILE), (last + TILE) // TILE)  # last >= -1 (padding rows)
    for t in range(0, n_tiles):
        kj = t * TILE + tl.arange(0, TILE)
        kpos = tl.load(kpos_ptr + b * s_kpb + kj, mask=kj < nk, other=0)
        # Keys no query of the block can see are never read (a pool may hold stale rows there).
        kread = (kj < nk) & (kpos <= last)
        krow = tl.load(kidx_ptr + b * s_ib + kj, mask=kread, other=0)
        k = tl.load(k_ptr + krow[:, None] * s_kt + kvh * s_kh + d[None, :], mask=kread[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = kread[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        mt = tl.max(s, axis=1)
        p = tl.exp(s - tl.where(mt == float("-inf"), 0.0, mt)[:, None])
        lt = tl.sum(p, axis=1)
        v = tl.load(v_ptr + krow[:, None] * s_vt + kvh * s_vh + d[None, :], mask=kread[:, None], other=0.0)
        if IEEE:
            at = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            at = tl.dot(p.to(v.dtype), v)
        m, den, acc = _merge(m, den, acc, mt, lt, at)
    o_rows = b * s_ob + qi * s_on + hi * s_oh
    if PARTIAL:
        mrow = b * s_mb + qi * s_mn + hi
        tl.store(m_ptr + mrow, m, mask=row_ok)
        tl.store(l_ptr + mrow, den, mask=row_ok)
        tl.store(out_ptr + o_rows[:, None] + d[None, :], acc, mask=row_ok[:, None])
    else:
        # A row that sees no key (padding) has l = 0 and acc = 0: it returns 0, not NaN.
        out = tl.math.div_rn(acc, tl.where(den == 0.0, 1.0, den)[:, None])
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_kernel(
    am_ptr,
    al_ptr,
    aacc_ptr,
    bm_ptr,
    bl_ptr,
    bacc_ptr,
    om_ptr,
    ol_ptr,
    oacc_ptr,
    rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < rows
    d = tl.arange(0, HEAD_DIM)
    idx = r[:, None] * HEAD_DIM + d[None, :]
    m, den, acc = _merge(
        tl.load(am_ptr + r, mask=ok, other=0.0),
        tl.load(al_ptr + r, mask=ok, other=0.0),
        tl.load(aacc_ptr + idx, mask=ok[:, None], other=0.0),
        tl.load(bm_ptr + r, mask=ok, other=0.0),
        tl.load(bl_ptr + r, mask=ok, other=0.0),
        tl.load(bacc_ptr + idx, mask=ok[:, None], other=0.0),
    )
    tl.store(om_ptr + r, m, mask=ok)
    tl.store(ol_ptr + r, den, mask=ok)
    tl.store(oacc_ptr + idx, acc, mask=ok[:, None])


@triton.jit
def _finalize_kernel(l_ptr, acc_ptr, out_ptr, rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < rows
    d = tl.arange(0, HEAD_DIM)
    idx = r[:, None] * HEAD_DIM + d[None, :]
    den = tl.load(l_ptr + r, mask=ok, other=1.0)
    acc = tl.load(acc_ptr + idx, mask=ok[:, None], other=0.0)
    out = tl.math.div_rn(acc, tl.where(den == 0.0, 1.0, den)[:, None])
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def attention_indexed(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_index: torch.Tensor,
    k_pos: torch.Tensor,
    num_keys: torch.Tensor,
    scale: float,
    partial: bool = False,
):
    """q [B, Nq, Hq, D] at q_pos [B, Nq] over keys k_buf/v_buf [T, Hkv, D]; batch row b's key j is token
    row kv_index[b, j] at position k_pos[b, j] (ascending), j < num_keys[b]. Returns [B, Nq, Hq, D] in
    q.dtype, or with `partial` the unnormalised fp32 state (m, l [B, Nq, Hq], acc [B, Nq, Hq, D])."""
    b, nq, hq, d = q.shape
    hkv = k_buf.shape[1]
    if hq % hkv or d & (d - 1) or d < 16:
        raise ValueError(f"need Hq ({hq}) a multiple of Hkv ({hkv}) and a power-of-two head_dim >= 16 ({d})")
    group = hq // hkv
    if group > BLOCK_M:
        raise ValueError(f"GQA group {group} exceeds the {BLOCK_M}-row block")
    for name, t in (("q", q), ("k", k_buf), ("v", v_buf)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    q_pos, k_pos = q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous()
    kv_index = kv_index.to(torch.int64).contiguous()
    num_keys = num_keys.to(torch.int32).contiguous()
    if partial:
        out = torch.empty(b, nq, hq, d, dtype=torch.float32, device=q.device)
        m = torch.empty(b, nq, hq, dtype=torch.float32, device=q.device)
        den = torch.empty_like(m)
    else:
        out = torch.empty(b, nq, hq, d, dtype=q.dtype, device=q.device)
        m = den = out  # unused
    if b * nq == 0:
        return (m, den, out) if partial else out
    grid = (triton.cdiv(nq, BLOCK_M // group), hkv, b)
    _attention_kernel[grid](
        q,
        q_pos,
        k_buf,
        v_buf,
        kv_index,
        k_pos,
        num_keys,
        out,
        m,
        den,
        float(scale),
        nq,
        k_buf.shape[0],
        group,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        q_pos.stride(0),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        kv_index.stride(0),
        k_pos.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        m.stride(0) if partial else 0,
        m.stride(1) if partial else 0,
        HEAD_DIM=d,
        BLOCK_M=BLOCK_M,
        TILE=TILE,
        PARTIAL=partial,
        IEEE=q.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        enable_fp_fusion=False,
    )
    return (m, den, out) if partial else out


def merge(a: tuple, b: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) of keys `a` then keys `b`, by the kernel's own merge formula."""
    am, al, aacc = (t.float().contiguous() for t in a)
    bm, bl, bacc = (t.float().contiguous() for t in b)
    d = aacc.shape[-1]
    om, ol, oacc = torch.empty_like(am), torch.empty_like(al), torch.empty_like(aacc)
    rows = am.numel()
    if rows:
        _merge_kernel[(triton.cdiv(rows, 64),)](
            am, al, aacc, bm, bl, bacc, om, ol, oacc, rows, HEAD_DIM=d, BLOCK_M=64, enable_fp_fusion=False
        )
    return om, ol, oacc


def finalize(den: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    den, acc = den.float().contiguous(), acc.float().contiguous()
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    rows = den.numel()
    if rows:
        _finalize_kernel[(triton.cdiv(rows, 64),)](
            den, acc, out, rows, HEAD_DIM=acc.shape[-1], BLOCK_M=64, enable_fp_fusion=False
        )
    return out
