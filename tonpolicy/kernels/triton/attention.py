"""Causal attention of the `triton` kernel set as one two-level merge tree: one definition for prefill,
chunked prefill, decode, the trainer's forward and ring-CP chunks (docs/REDUCTION_RULES.md, "Triton
attention").

Keys are cut into chunks of CHUNK keys aligned to key index 0 (= position 0), each chunk into TILE-key
tiles. Inside a chunk the tiles are folded in key order by FlashAttention's online recurrence (one
running max per row, one exp per row per tile for the rescale, one accumulator that the p.v dot
accumulates into); the chunk states are then merged in key order by the one `merge` formula. Prefill
and the trainer walk the chunks in one program (`_attention_kernel`, SPLIT off); decode runs one
program per (chunk, query block, KV head, sequence) and then `_fold_chunks_kernel` folds each row's
chunk states in key order (split-KV with a fixed split size, CHUNK). Both compute the same chunk states
and the same merges, so the path never changes a bit.

A program owns BLOCK_M rows: up to BLOCK_M // G queries of one sequence times the G query heads that
share a KV head (GQA heads packed as rows; the rest padded). Keys are read through an index table (a
token row per key), so contiguous keys, the embedded engine's KV pool and SGLang's paged pool all go
through the same code. A tile no query of the block can see is skipped; a tile fully masked for a row
leaves that row's state as it was (rescale by exp(0) = 1, p = 0), and merging an empty chunk state is
an exact no-op, so a query's bits never depend on the other queries of its block, on how the sequence
was chunked, or on how many keys the cache holds beyond it. A tile every row of the block sees whole
skips the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tonpolicy.kernels import TRITON_ATTENTION_TILE as TILE
from tonpolicy.kernels.triton.interpreter import use_torch_dot

use_torch_dot()  # in Triton's interpreter (tests on a CPU): tl.dot as a fixed-order tile GEMM

BLOCK_M = 64
# The fixed split size: part of the definition (another value gives other bits), not a schedule knob.
CHUNK = 2 * TILE
TILES_PER_CHUNK = CHUNK // TILE
# 3 pipeline stages: faster than 2 on an H200 at prefill and decode, with the same bits
# (experiments/results/gpu_triton_h200.json, "tune").
NUM_WARPS, NUM_STAGES = 4, 3
# Rows per program of split-KV's fold: few, so a decode batch's fold spreads over many SMs (the fold is
# elementwise per row: any count gives the same bits).
FOLD_ROWS = 16
# Split-KV pays where one program per (query block, KV head, sequence) would leave SMs idle (small decode
# batches), and its chunk states take memory in proportion to the index table's width: it is used below
# this many programs and this many bytes of states. The path never changes a bit.
SPLIT_BELOW_PROGRAMS = 512
SPLIT_STATE_BYTES = 128 << 20
QUERY_PAD_POS = tl.constexpr(-1)
NO_QUERY_POS = tl.constexpr(2**62)  # a padding row's position for the block's smallest query position


@triton.jit
def _merge(m, den, acc, mt, lt, at):
    """The one merge formula: (m, l, acc) covers keys before (mt, lt, at); an empty right state
    (mt = -inf) leaves the left one exactly."""
    mn = tl.maximum(m, mt)
    ms = tl.where(mn == float("-inf"), 0.0, mn)
    ca = tl.exp(m - ms)
    cb = tl.exp(mt - ms)
    empty = mt == float("-inf")
    den = tl.where(empty, den, den * ca + lt * cb)
    acc = tl.where(empty[:, None], acc, acc * ca[:, None] + at * cb[:, None])
    return mn, den, acc


@triton.jit
def _tile_step(
    m,
    den,
    acc,
    t,
    q,
    qpos,
    qmin,
    last,
    nk,
    k_ptr,
    v_ptr,
    kidx_ptr,
    kpos_ptr,
    kvh,
    scale,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Tile t folded into a chunk's running (m, l, acc) by FlashAttention's online recurrence. kidx_ptr
    and kpos_ptr already point at this sequence's index and position rows."""
    d = tl.arange(0, HEAD_DIM)
    kj = t * TILE + tl.arange(0, TILE)
    kpos = tl.load(kpos_ptr + kj, mask=kj < nk, other=0)
    # Keys no query of the block can see are never read (a pool may hold stale rows there).
    kread = (kj < nk) & (kpos <= last)
    krow = tl.load(kidx_ptr + kj, mask=kread, other=0)
    k = tl.load(k_ptr + krow[:, None] * s_kt + kvh * s_kh + d[None, :], mask=kread[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    # Positions ascend, so a whole tile below every row's position is visible to all: no mask.
    if (t * TILE + TILE > nk) | (tl.max(kpos, axis=0) > qmin):
        s = tl.where(kread[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
    mn = tl.maximum(m, tl.max(s, axis=1))
    ms = tl.where(mn == float("-inf"), 0.0, mn)
    alpha = tl.exp(m - ms)
    p = tl.exp(s - ms[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + krow[:, None] * s_vt + kvh * s_vh + d[None, :], mask=kread[:, None], other=0.0)
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return mn, den, acc


@triton.jit(do_not_specialize=["nq", "k_rows", "n_chunks"])
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
    n_chunks,
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
    s_oc,
    s_on,
    s_oh,
    s_mb,
    s_mc,
    s_mn,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    PARTIAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    """SPLIT: the program for chunk program_id(0) % n_chunks writes that chunk's state (fp32) at
    [b, chunk, query, head]. Otherwise the program walks every chunk and merges them in key order,
    writing the output (or with PARTIAL the merged fp32 state)."""
    pid_q, kvh, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if SPLIT:
        c = pid_q % n_chunks
        pid_q = pid_q // n_chunks
    rows = tl.arange(0, BLOCK_M)
    per_block = BLOCK_M // group
    qi = pid_q * per_block + rows // group
    hi = kvh * group + rows % group
    row_ok = (rows < per_block * group) & (qi < nq)
    d = tl.arange(0, HEAD_DIM)
    q_at = q_ptr + b * s_qb + qi[:, None] * s_qn + hi[:, None] * s_qh + d[None, :]
    qpos = tl.load(qpos_ptr + b * s_pb + qi, mask=row_ok, other=QUERY_PAD_POS)
    last = tl.max(qpos, axis=0)
    qmin = tl.min(tl.where(row_ok, qpos, NO_QUERY_POS), axis=0)
    nk = tl.load(nkeys_ptr + b)
    # Key positions are ascending, distinct and >= 0, so key j sits at position >= j: tiles past the
    # block's last query position hold no visible key and are skipped (an exact no-op).
    n_tiles = tl.minimum(tl.cdiv(nk, TILE), (last + TILE) // TILE)  # last >= -1 (padding rows)
    kidx_row = kidx_ptr + b * s_ib
    kpos_row = kpos_ptr + b * s_kpb
    if SPLIT:
        # Only chunks some row of the block reaches run (and are stored); the fold reads no other.
        if c * TILES_PER_CHUNK < n_tiles:
            q = tl.load(q_at, mask=row_ok[:, None], other=0.0)
            m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            den = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
            for t in range(c * TILES_PER_CHUNK, tl.minimum(c * TILES_PER_CHUNK + TILES_PER_CHUNK, n_tiles)):
                m, den, acc = _tile_step(
                    m, den, acc, t, q, qpos, qmin, last, nk, k_ptr, v_ptr, kidx_row, kpos_row, kvh, scale,
                    s_kt, s_kh, s_vt, s_vh, HEAD_DIM, TILE, IEEE,
                )  # fmt: skip
            mrow = b * s_mb + c * s_mc + qi * s_mn + hi
            tl.store(m_ptr + mrow, m, mask=row_ok)
            tl.store(l_ptr + mrow, den, mask=row_ok)
            o_rows = b * s_ob + c * s_oc + qi * s_on + hi * s_oh
            tl.store(out_ptr + o_rows[:, None] + d[None, :], acc, mask=row_ok[:, None])
    else:
        q = tl.load(q_at, mask=row_ok[:, None], other=0.0)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        den = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        mc = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        lc = tl.zeros((BLOCK_M,), tl.float32)
        ac = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        # One flat loop over the tiles (so it software-pipelines across chunks); at a chunk's last tile
        # its state is merged into (m, l, acc) and restarts empty.
        for t in range(0, n_tiles):
            mc, lc, ac = _tile_step(
                mc, lc, ac, t, q, qpos, qmin, last, nk, k_ptr, v_ptr, kidx_row, kpos_row, kvh, scale,
                s_kt, s_kh, s_vt, s_vh, HEAD_DIM, TILE, IEEE,
            )  # fmt: skip
            if (t % TILES_PER_CHUNK == TILES_PER_CHUNK - 1) | (t == n_tiles - 1):
                m, den, acc = _merge(m, den, acc, mc, lc, ac)
                mc = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                lc = tl.zeros((BLOCK_M,), tl.float32)
                ac = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
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


@triton.jit(do_not_specialize=["rows", "per_seq", "n_chunks"])
def _fold_chunks_kernel(
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    qpos_ptr,
    nkeys_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    rows,
    per_seq,
    n_chunks,
    nq,
    s_pb,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """Split-KV's second stage: each (sequence, query, head) row folds its chunk states [B, C, Nq, Hq]
    in key order with `_merge`, as the one-program path does, then normalises (or with PARTIAL keeps
    the fp32 state). A row folds the chunks that hold keys up to its position; merging a chunk it
    cannot see would be an exact no-op anyway."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < rows
    b = r // per_seq
    within = r % per_seq
    hq = per_seq // nq
    qpos = tl.load(qpos_ptr + b * s_pb + within // hq, mask=ok, other=QUERY_PAD_POS)
    nk = tl.load(nkeys_ptr + b, mask=ok, other=0)
    mine = tl.minimum(tl.cdiv(nk, CHUNK), (qpos + CHUNK) // CHUNK)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for c in range(0, tl.max(tl.where(ok, mine, 0), axis=0)):
        take = ok & (c < mine)
        at = (b * n_chunks + c) * per_seq + within
        m, den, acc = _merge(
            m,
            den,
            acc,
            tl.load(pm_ptr + at, mask=take, other=float("-inf")),
            tl.load(pl_ptr + at, mask=take, other=0.0),
            tl.load(pacc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=take[:, None], other=0.0),
        )
    idx = r[:, None] * HEAD_DIM + d[None, :]
    if PARTIAL:
        tl.store(m_ptr + r, m, mask=ok)
        tl.store(l_ptr + r, den, mask=ok)
        tl.store(out_ptr + idx, acc, mask=ok[:, None])
    else:
        out = tl.math.div_rn(acc, tl.where(den == 0.0, 1.0, den)[:, None])
        tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


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


def split_kv(b: int, nq: int, hq: int, hkv: int, d: int, width: int) -> bool:
    """Whether `attention_indexed` runs split-KV for these shapes (width: the index table's)."""
    n_chunks = triton.cdiv(width, CHUNK)
    state_bytes = b * n_chunks * nq * hq * (d + 2) * 4
    one_block = nq <= BLOCK_M // (hq // hkv)
    return one_block and n_chunks > 1 and b * hkv < SPLIT_BELOW_PROGRAMS and state_bytes <= SPLIT_STATE_BYTES


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
    split: bool | None = None,
):
    """q [B, Nq, Hq, D] at q_pos [B, Nq] over keys k_buf/v_buf [T, Hkv, D]; batch row b's key j is token
    row kv_index[b, j] at position k_pos[b, j] (ascending), j < num_keys[b] <= kv_index.shape[1]. Returns
    [B, Nq, Hq, D] in q.dtype, or with `partial` the unnormalised fp32 state (m, l [B, Nq, Hq], acc
    [B, Nq, Hq, D]). `split` picks split-KV (one program per chunk, then the fold) or one program per
    query block; None: split when every sequence's queries fit one block (decode) and the batch is small
    (SPLIT_BELOW_PROGRAMS, SPLIT_STATE_BYTES). Same bits either way."""
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
    per_block = BLOCK_M // group
    # The index table's width bounds every sequence's keys: a fixed grid, also inside a CUDA graph.
    n_chunks = max(triton.cdiv(kv_index.shape[1], CHUNK), 1)
    if split is None:
        split = split_kv(b, nq, hq, hkv, d, kv_index.shape[1])
    dev = q.device
    if partial:
        out = torch.empty(b, nq, hq, d, dtype=torch.float32, device=dev)
        m = torch.empty(b, nq, hq, dtype=torch.float32, device=dev)
        den = torch.empty_like(m)
    else:
        out = torch.empty(b, nq, hq, d, dtype=q.dtype, device=dev)
        m = den = out  # unused
    if b * nq == 0:
        return (m, den, out) if partial else out
    if split:
        st_acc = torch.empty(b, n_chunks, nq, hq, d, dtype=torch.float32, device=dev)
        st_m = torch.empty(b, n_chunks, nq, hq, dtype=torch.float32, device=dev)
        st_l = torch.empty_like(st_m)
        target, tm, tl_ = st_acc, st_m, st_l
        grid = (triton.cdiv(nq, per_block) * n_chunks, hkv, b)
    else:
        target, tm, tl_ = out, m, den
        grid = (triton.cdiv(nq, per_block), hkv, b)
    o_strides = (
        (target.stride(0), target.stride(1), target.stride(-3), target.stride(-2))
        if split
        else (out.stride(0), 0, out.stride(1), out.stride(2))
    )
    m_strides = (
        (tm.stride(0), tm.stride(1), tm.stride(2))
        if split
        else ((m.stride(0), 0, m.stride(1)) if partial else (0, 0, 0))
    )
    _attention_kernel[grid](
        q,
        q_pos,
        k_buf,
        v_buf,
        kv_index,
        k_pos,
        num_keys,
        target,
        tm,
        tl_,
        float(scale),
        nq,
        k_buf.shape[0],
        n_chunks,
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
        *o_strides,
        *m_strides,
        HEAD_DIM=d,
        BLOCK_M=BLOCK_M,
        TILE=TILE,
        TILES_PER_CHUNK=TILES_PER_CHUNK,
        SPLIT=split,
        PARTIAL=partial,
        IEEE=q.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        enable_fp_fusion=False,
    )
    if split:
        rows = b * nq * hq
        _fold_chunks_kernel[(triton.cdiv(rows, FOLD_ROWS),)](
            st_m,
            st_l,
            st_acc,
            q_pos,
            num_keys,
            out,
            m,
            den,
            rows,
            nq * hq,
            n_chunks,
            nq,
            q_pos.stride(0),
            HEAD_DIM=d,
            BLOCK_M=FOLD_ROWS,
            CHUNK=CHUNK,
            PARTIAL=partial,
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
