"""Invariant fp32-accumulating matmul for the `invariant` kernel set.

Why this shape of computation (measured on torch 2.13 and 2.14 CPU, see tests/test_kernels_linear.py):
- a plain GEMM's row result depends on M (MKL picks different paths), so every GEMM here has a fixed
  shape: [prefill_row_tile, K/C] x [K/C, N] tiles, the remaining rows zero-padded to a multiple of
  `row_granule` (4) in one GEMM, all as `torch.bmm` whose per-matrix result was invariant to the batch
  count, the row count (any multiple of 4), the row offset, the column count N (column shards), and the
  thread count;
- K is cut into `C` canonical shards; each shard's partial has identical shapes whatever the TP,
  and `tree_sum` adds them in fp32 in a fixed pairwise tree, so TP=1/2/4 give the same bits.
GEMM precision: bf16 operands go to the CPU's native bf16 GEMM (exact products, fp32 accumulation inside
the kernel, one rounding of each output to bf16: what the trainer and SGLang do in bf16); fp32 operands,
mixed operands and the LM head's fp32 logits use an fp32 GEMM (bf16 upcast exactly, a cache-sized slab
of the weight at a time: no fp32 copy of any weight is kept).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tonpolicy.cpu_numerics import amx_settings_active

# Output columns per upcast slab of a low-precision weight in an fp32 GEMM: the slab ([slab, K] fp32)
# stays in cache, so the GEMM reads the weight's own bytes once instead of an fp32 copy twice as large.
WEIGHT_SLAB = 1024
# Under an AMX CPU's GEMM settings MKL's strict mode gives a score the same bits at any column count
# (measured down to 6 columns, 1 and 2 threads): there a slab of 256 columns (1 MiB at K=1024, in L2)
# does the LM head's decode GEMM in ~20% less time than 1024 (large model, 32000 x 1024: 27.3 -> 21.7 ms).
AMX_WEIGHT_SLAB = 256
# Under an AMX CPU's GEMM settings (tonpolicy.cpu_numerics) oneDNN's bf16 GEMM gives the same row bits for
# any row count from 2 on, not only multiples of 4 (1 row takes a GEMV path with other bits for large
# weights): measured, tests/test_kernels_linear.py. A lone decode row costs 2 rows there, not 4 (-22%).
AMX_BF16_MIN_ROWS = 2
# Read once: the GEMM libraries read the settings at their first call, so a process keeps what it began with.
_under_amx_settings = functools.cache(amx_settings_active)
# Weights of at most this many elements take `_bf16_small_weight` (bf16, no autograd): measured faster up
# to 128 x 384, slower from 256 x 512 on.
SMALL_WEIGHT = 1 << 16


def _tile_gemms(x: torch.Tensor, wf: torch.Tensor, num_shards: int, rows: int, out: torch.Tensor | None):
    """Per-shard bmm of x [mt*rows, K] (row-major) in tiles of `rows`: every GEMM is [rows, K/C] x [K/C, N]
    (weight slice as a stride-0 batch). Writes into out [C, mt*rows, N] when given (no autograd)."""
    k, n = x.shape[1], wf.shape[0]
    ks = k // num_shards
    mt = x.shape[0] // rows
    xt = x.view(mt, rows, k)
    outs = []
    for s in range(num_shards):
        a = xt[:, :, s * ks : (s + 1) * ks]
        b = wf[:, s * ks : (s + 1) * ks].t().unsqueeze(0).expand(mt, ks, n)
        if out is None:
            outs.append(torch.bmm(a, b).view(mt * rows, n))
        else:
            torch.bmm(a, b, out=out[s].view(mt, rows, n))
    return torch.stack(outs) if out is None else out


def _bf16_small_weight(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
    """[C, M, N] bf16: all K-shards in one bf16 `bmm` of the row shards [C, M, K/C] (one copy) and the
    weight's shards as a view. The same bits as `_bf16_partials` (measured: every multiple-of-4 row
    count, both torch builds), at a fraction of the per-call cost; slower for large weights, which
    that `bmm` copies per call."""
    m, k = x.shape
    ks = k // num_shards
    rows = x.view(m, num_shards, ks).transpose(0, 1).contiguous()
    return torch.bmm(rows, w.view(w.shape[0], num_shards, ks).permute(1, 2, 0))


def _bf16_partials(x: torch.Tensor, w: torch.Tensor, num_shards: int, big: int, m_big: int) -> torch.Tensor:
    """[C, M, N] bf16: per K-shard, oneDNN's bf16 GEMM (`F.linear`, or the same `mm` writing into the
    result) on row tiles of `big` rows and one tail. Measured: the row bits are equal for any multiple-
    of-4 row count and for strided shard views, in both torch builds; bf16 `torch.bmm` gives the same
    bits but takes a ~40x slower path."""
    m, k = x.shape
    ks = k // num_shards
    bounds = list(range(0, m_big, big)) + [m_big]
    if m > m_big:
        bounds.append(m)
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    tracked = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    out = None if tracked else x.new_empty(num_shards, m, w.shape[0])
    shards = []
    for s in range(num_shards):
        xs, ws = x[:, s * ks : (s + 1) * ks], w[:, s * ks : (s + 1) * ks]
        if out is not None:
            for a, b in spans:
                torch.mm(xs[a:b], ws.t(), out=out[s, a:b])
            continue
        tiles = [F.linear(xs[a:b], ws) for a, b in spans]
        shards.append(torch.cat(tiles) if len(tiles) > 1 else tiles[0])
    return out if out is not None else torch.stack(shards)


def tiled_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    num_shards: int,
    row_granule: int,
    big_row_tile: int | None = None,
    fp32: bool = False,
) -> torch.Tensor:
    """Partials [num_shards, ..., N] of x [..., K] @ weight[N, K].T over equal K shards: bf16 when both
    operands are bf16 (native bf16 GEMM) unless `fp32`, else fp32.

    Rows go through GEMMs of fixed shape: whole tiles of `big_row_tile` rows first (prefill), the rest
    in one GEMM zero-padded to a multiple of `row_granule` rows. Every row count that is a multiple of 4
    gives identical row bits (measured over many shapes, 1 and 2 threads, both torch builds:
    tests/test_kernels_linear.py); 1-3 rows do not (a gemv-like path). The big tile amortises the
    per-GEMM packing of the weight; the granule keeps decode from padding one row to a 16-row tile."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or k % num_shards:
        raise ValueError(f"K={k} must match weight {tuple(weight.shape)} and divide into {num_shards} shards")
    m = x.numel() // k
    big = big_row_tile if big_row_tile and big_row_tile > row_granule else row_granule
    m_big = (m // big) * big
    m_pad = max(m_big + -(-(m - m_big) // row_granule) * row_granule, row_granule)
    if not fp32 and x.dtype == weight.dtype == torch.bfloat16:
        if _under_amx_settings():  # any row count from 2 on gives the same row bits there: pad less
            m_pad = m_big + max(m - m_big, AMX_BF16_MIN_ROWS) if m > m_big else max(m, AMX_BF16_MIN_ROWS)
        x2 = x.reshape(-1, k)
        if m_pad != m:
            x2 = F.pad(x2, (0, 0, 0, m_pad - m))
        tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if num_shards == 1 and m_big == 0 and not tracked:  # decode: one GEMM, as `_bf16_partials` runs it
            parts = torch.mm(x2, weight.t()).unsqueeze(0)
        elif weight.numel() <= SMALL_WEIGHT and not tracked:
            parts = _bf16_small_weight(x2, weight, num_shards)
        else:
            parts = _bf16_partials(x2, weight, num_shards, big, m_big)
        return parts[:, :m].reshape(num_shards, *lead, n)
    # Row-major operands always: a transposed operand selects another GEMM kernel (other bits).
    x2 = x.reshape(-1, k).float().contiguous()
    if m_pad != m:
        x2 = F.pad(x2, (0, 0, 0, m_pad - m))
    tracked = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if tracked:  # trainer parameters: the autograd graph through one upcast
        full = _fp32_gemms(x2, weight.float(), num_shards, big, m_big, None)
    elif weight.dtype == torch.float32:
        full = _fp32_gemms(x2, weight, num_shards, big, m_big, x2.new_empty(num_shards, m_pad, n))
    else:
        # Upcast (exactly) one slab of output columns at a time into one buffer: every score's bits are
        # independent of the GEMM's column count (measured), so slabs give the full GEMM's bits.
        # Every slab is WEIGHT_SLAB columns wide: the last one overlaps its neighbour (those columns come
        # out the same) rather than being a few columns, which a GEMM computes another way.
        width = min(n, AMX_WEIGHT_SLAB if _under_amx_settings() else WEIGHT_SLAB)
        full = x2.new_empty(num_shards, m_pad, n)
        slab = x2.new_empty(width, k)
        for c0 in range(0, n, width):
            c0 = min(c0, n - width)
            wf = slab.copy_(weight[c0 : c0 + width])
            _fp32_gemms(x2, wf, num_shards, big, m_big, full[:, :, c0 : c0 + width])
    return full[:, :m].reshape(num_shards, *lead, n)


def _fp32_gemms(
    x2: torch.Tensor, wf: torch.Tensor, num_shards: int, big: int, m_big: int, out: torch.Tensor | None
) -> torch.Tensor:
    """fp32 partials [C, M_pad, N] of padded rows x2 [M_pad, K] and wf [N, K] (row tiles of `big`
    rows, then the tail in one GEMM); written into `out` when given (no autograd, no copies)."""
    m_pad, k = x2.shape
    ks = k // num_shards
    if m_big == 0:
        # Short input (decode): one GEMM of the padded rows, the shards as the bmm batch (same
        # per-matrix GEMM as the tiles', measured).
        a = x2.unflatten(1, (num_shards, ks)).transpose(0, 1)
        b = wf.unflatten(1, (num_shards, ks)).permute(1, 2, 0)
        return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)
    parts = [_tile_gemms(x2[:m_big], wf, num_shards, big, None if out is None else out[:, :m_big])]
    if m_pad > m_big:
        tail = m_pad - m_big
        parts.append(_tile_gemms(x2[m_big:], wf, num_shards, tail, None if out is None else out[:, m_big:]))
    if out is not None:
        return out
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


# Elements per row block of a large untracked tree sum: the block's fp32 temporaries stay in cache, where
# whole-tensor temporaries of a long prefill stream through memory (measured on [4, 2048, 1024] bf16
# partials, 1 thread: 14.2 ms whole, 3.5 ms in blocks of 64 rows). Elementwise adds: the same bits.
SUM_BLOCK = 1 << 16


def tree_sum(partials: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum along dim 0 in fp32 in a fixed pairwise tree: ((p0+p1)+(p2+p3)) for 4 partials; the fp32 sum
    rounded once to `out_dtype`."""
    tracked = torch.is_grad_enabled() and partials.requires_grad
    n = partials.shape[-1]
    rows = partials[0].numel() // max(n, 1)
    block = max(4, SUM_BLOCK // max(n, 1))
    if tracked or partials.shape[0] == 1 or rows <= 2 * block:
        return _tree(partials, tracked).to(out_dtype)
    flat = partials.reshape(partials.shape[0], rows, n)
    out = partials.new_empty(rows, n, dtype=out_dtype)
    for a in range(0, rows, block):
        out[a : a + block] = _tree(flat[:, a : a + block], False)
    return out.view(partials.shape[1:])


def _tree(partials: torch.Tensor, tracked: bool) -> torch.Tensor:
    parts = list(partials.unbind(0))
    if len(parts) == 1:
        return parts[0].float()
    # The first level makes fresh fp32 sums (a bf16 operand is upcast exactly); later levels add into
    # them in place: the same bits, and ~6x faster than page-faulting fresh buffers for every sum.
    level = [parts[i].float() + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
    if len(parts) % 2:
        level.append(parts[-1].float())  # an odd one out is only ever added, never added into
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] if tracked else level[i].add_(level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]
