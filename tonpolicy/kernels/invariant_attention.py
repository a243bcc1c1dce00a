"""Split-KV causal attention with a fixed key tile, the `invariant` way.

Every query's result is built from key tiles of exactly `tile` keys. For one tile the partial is
(m, l, acc): m = max of the scaled scores (exact), p = exp(s - m) (masked keys give exactly 0),
l = last-dim sum of p over `tile` values, acc = p @ v. Scores and p @ v are fixed-shape fp32 GEMMs
([R, D] x [D, tile] and [R, tile] x [tile, D], R = row_tile queries x the G query heads of one KV head)
batched by `torch.bmm`, whose per-matrix result was measured invariant to the batch count, the thread
count and the row's position inside its tile. Partials are merged left to right in key order by
`merge`. A fully masked tile yields exactly (m=-inf, l=0, acc=0) and merging it is an exact no-op (up to
the sign of an all-zero accumulator), so such (query tile, key tile) pairs are skipped rather than
computed; prefill (all tiles), decode (tiles up to the cache length) and chunked prefill therefore give
the same bits. `torch.exp` is used (its scalar-tail and vector paths agreed on millions of inputs);
`sigmoid`/`silu` are avoided (they do not).
"""

from __future__ import annotations

import math

import torch

from tonpolicy.kernels.base import AttnPartial

# Position given to padded keys: larger than any query, so the causal mask removes them.
KEY_PAD_POS = 2**62
# Position given to padded queries: smaller than any key, so they see nothing (their rows are dropped).
QUERY_PAD_POS = -1
NEG_INF = float("-inf")


def query_row_tile(nq: int, group: int, row_tile: int, granule: int) -> int:
    """Queries per GEMM row tile: `row_tile` (rounded up so that its rows, queries x `group` heads, are a
    multiple of `granule`), or for fewer queries (decode) the fewest such. Every multiple-of-4 row count
    gives the same row bits (measured, tests/test_kernels_attention.py), so the tile is a speed knob and
    decode pads 1 query to 4 rows, not to a whole tile."""
    step = granule // math.gcd(group, granule)
    return min(-(-row_tile // step) * step, -(-nq // step) * step)


def _safe(m: torch.Tensor) -> torch.Tensor:
    # A fully masked row has m = -inf; subtract 0 instead so exp(-inf - 0) = 0, never NaN.
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def merge(a: AttnPartial, b: AttnPartial) -> AttnPartial:
    """The one merge formula; `a` covers keys before `b`."""
    m = torch.maximum(a.m, b.m)
    ms = _safe(m)
    ca = torch.exp(a.m - ms)
    cb = torch.exp(b.m - ms)
    l = a.l * ca + b.l * cb  # noqa: E741
    acc = a.acc * ca.unsqueeze(-1) + b.acc * cb.unsqueeze(-1)
    return AttnPartial(m, l, acc)


def finalize(p: AttnPartial, dtype: torch.dtype) -> torch.Tensor:
    # A query that sees no key (only padding rows) has l = 0, acc = 0: return 0, not 0/0 = NaN (which
    # would poison a backward pass). Real rows have l >= 1, so their bits are untouched.
    l = torch.where(p.l == 0, torch.ones_like(p.l), p.l)  # noqa: E741
    return (p.acc / l.unsqueeze(-1)).to(dtype)


def merge_tiles(p: AttnPartial) -> AttnPartial:
    """Left-to-right `merge` over the tile axis, which is dim 0 (m/l [Kt, ...], acc [Kt, ..., D]).

    Bitwise equal to folding `merge` tile by tile: the running max is an exact cummax, and the
    factors exp(M_prev - M) and exp(m_t - M) are the very values `merge` would compute."""
    kt = p.m.shape[0]
    if kt == 1:
        return AttnPartial(p.m[0], p.l[0], p.acc[0])
    run_m = torch.cummax(p.m, dim=0).values
    prev_m = torch.cat([p.m[:1], run_m[:-1]], dim=0)
    ms = _safe(run_m)
    ca = torch.exp(prev_m - ms)
    cb = torch.exp(p.m - ms)
    lb = p.l * cb
    ab = p.acc * cb.unsqueeze(-1)
    ca_acc = ca.unsqueeze(-1)
    l_run, a_run = p.l[0], p.acc[0]
    for t in range(1, kt):
        l_run = l_run * ca[t] + lb[t]
        a_run = a_run * ca_acc[t] + ab[t]
    return AttnPartial(run_m[-1], l_run, a_run)


def tile_partials(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    kpos_store: torch.Tensor,
    store_index: torch.Tensor,
    num_tiles: int,
    scale: float,
    row_tile: int,
) -> AttnPartial:
    """Per-tile partials of a batch of query blocks over tiled key stores.

    q [B, Nq, Hq, D], q_pos [B, Nq]. Keys live in stores, each tile in its GEMM layout: k_store
    [S, Kt_s, Hkv, D, T], v_store [S, Kt_s, Hkv, T, D], kpos_store [S, Kt_s, T]; batch row b reads
    store `store_index[b]`, tiles [0, num_tiles).
    Returns dense partials with m/l [Kt, B, Qt, Hkv, R] and acc [Kt, B, Qt, Hkv, R, D]
    (Kt = num_tiles first, for the key-order merge; R = row_tile * G rows ordered (query, head in group)).
    """
    b, nq, hq, d = q.shape
    hkv, tile = k_store.shape[2], k_store.shape[4]
    g = hq // hkv
    qt = max(1, -(-nq // row_tile))
    qp = qt * row_tile
    r = row_tile * g
    qf = q.float()
    if qp != nq:
        qf = torch.cat([qf, qf.new_zeros(b, qp - nq, hq, d)], dim=1)
        q_pos = torch.cat([q_pos, q_pos.new_full((b, qp - nq), QUERY_PAD_POS)], dim=1)
    q_tiles = qf.view(b, qt, row_tile, hkv, g, d).permute(0, 1, 3, 2, 4, 5).reshape(b, qt, hkv, r, d)
    qpos_rows = q_pos.view(b, qt, row_tile, 1).expand(b, qt, row_tile, g).reshape(b, qt, r)
    kpos = kpos_store[store_index, :num_tiles]  # [B, Kt, T]
    # A (query tile, key tile) pair is computed only if some key of the tile is visible to some query.
    valid = kpos.amin(-1)[:, None, :] <= q_pos.view(b, qt, row_tile).amax(-1)[:, :, None]
    ki, bi, qi = valid.permute(2, 0, 1).nonzero(as_tuple=True)  # tile-major pair order
    npairs = bi.numel()
    si = store_index[bi]
    # Every GEMM operand is made row-major contiguous: bmm picks a different kernel for a transposed
    # operand (and reshape of a permuted view may or may not copy), which changes the bits.
    a = q_tiles[bi, qi].reshape(npairs * hkv, r, d).contiguous()
    # Whole tiles gathered, already in the GEMM layout (contiguous; the fp32 upcast is exact).
    kt_ = k_store[si, ki].float().reshape(npairs * hkv, d, tile).contiguous()
    # In place where nothing is differentiated (the same ops, so the same bits, without fresh buffers).
    inplace = not (torch.is_grad_enabled() and (q.requires_grad or k_store.requires_grad or v_store.requires_grad))
    s = torch.bmm(a, kt_).view(npairs, hkv, r, tile)
    s = s.mul_(scale) if inplace else s * scale
    hidden = kpos[bi, ki].view(npairs, 1, 1, tile) > qpos_rows[bi, qi].view(npairs, 1, r, 1)
    s = s.masked_fill_(hidden, NEG_INF) if inplace else s.masked_fill(hidden, NEG_INF)
    m = s.amax(dim=-1)
    p = s.sub_(_safe(m).unsqueeze(-1)).exp_() if inplace else torch.exp(s - _safe(m).unsqueeze(-1))
    l = p.sum(dim=-1)  # noqa: E741
    vt = v_store[si, ki].float().reshape(npairs * hkv, tile, d).contiguous()
    acc = torch.bmm(p.reshape(npairs * hkv, r, tile).contiguous(), vt).view(npairs, hkv, r, d)
    if npairs == num_tiles * b * qt:  # every pair visible: the tile-major pair order is the dense order
        return AttnPartial(
            m.view(num_tiles, b, qt, hkv, r), l.view(num_tiles, b, qt, hkv, r), acc.view(num_tiles, b, qt, hkv, r, d)
        )
    # Skipped pairs hold exactly what computing them would give: (-inf, 0, 0).
    m_d = m.new_full((num_tiles, b, qt, hkv, r), NEG_INF)
    l_d = l.new_zeros(num_tiles, b, qt, hkv, r)
    acc_d = acc.new_zeros(num_tiles, b, qt, hkv, r, d)
    m_d[ki, bi, qi] = m
    l_d[ki, bi, qi] = l
    acc_d[ki, bi, qi] = acc
    return AttnPartial(m_d, l_d, acc_d)


def unpack_rows(x: torch.Tensor, nq: int, row_tile: int) -> torch.Tensor:
    """[B, Qt, Hkv, R(, D)] -> [B, Nq, Hq(, D)]."""
    b, qt, hkv, r = x.shape[:4]
    g = r // row_tile
    tail = x.shape[4:]
    x = x.reshape(b, qt, hkv, row_tile, g, *tail).transpose(2, 3).reshape(b, qt * row_tile, hkv * g, *tail)
    return x[:, :nq]


def to_store(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tile: int):
    """Token-major keys [B, Nk, Hkv, D] -> tiled stores in the GEMM layout (k [B, Kt, Hkv, D, T],
    v [B, Kt, Hkv, T, D]), padded with zero k/v at KEY_PAD_POS."""
    b, nk, hkv, d = k.shape
    kt = max(1, -(-nk // tile))
    extra = kt * tile - nk
    if extra:
        k = torch.cat([k, k.new_zeros(b, extra, hkv, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, extra, hkv, d)], dim=1)
        k_pos = torch.cat([k_pos, k_pos.new_full((b, extra), KEY_PAD_POS)], dim=1)
    ks = k.view(b, kt, tile, hkv, d).permute(0, 1, 3, 4, 2).contiguous()
    vs = v.view(b, kt, tile, hkv, d).permute(0, 1, 3, 2, 4).contiguous()
    return ks, vs, k_pos.reshape(b, kt, tile), kt


def attention_stores(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    kpos_store: torch.Tensor,
    store_index: torch.Tensor,
    num_tiles: int,
    scale: float,
    row_tile: int,
    granule: int,
) -> torch.Tensor:
    """Attention of q [B, Nq, Hq, D] over tiled key stores (see tile_partials) -> [B, Nq, Hq, D]."""
    row_tile = query_row_tile(q.shape[1], q.shape[2] // k_store.shape[2], row_tile, granule)
    parts = tile_partials(q, q_pos, k_store, v_store, kpos_store, store_index, num_tiles, scale, row_tile)
    out = finalize(merge_tiles(parts), q.dtype)  # [B, Qt, Hkv, R, D]
    return unpack_rows(out, q.shape[1], row_tile)


# Scores of one query block held at once (fp32 elements): bounds memory for long sequences.
SCORE_BUDGET = 1 << 23


def attention_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tile: int,
    row_tile: int,
    granule: int,
) -> torch.Tensor:
    """q [B, Nq, Hq, D] over k/v [B, Nk, Hkv, D] (positions [B, N]) -> [B, Nq, Hq, D] in q.dtype.

    The same partials as `attention_stores`, computed without gathering (query tile, key tile) pairs:
    a query block's scores for all its key tiles are one GEMM ([rows, D] x [D, tiles * T]; each score's
    bits do not depend on the GEMM's row or column count, measured: tests/test_kernels_attention.py),
    and each tile's p @ v one batched GEMM. A tile no query of the block sees gives exactly
    (-inf, 0, 0), as a skipped pair does; tiles past the last one the block sees are not merged (an
    exact no-op, as in decode). `row_tile` does not apply here."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    ks, vs, kps, kt = _key_tiles(k, v, k_pos, tile)
    step = granule // math.gcd(g, granule)  # queries whose g rows make a multiple of the GEMM granule
    nqp = -(-nq // step) * step
    qf = q.float()
    if nqp != nq:
        qf = torch.cat([qf, qf.new_zeros(b, nqp - nq, hq, d)], dim=1)
        q_pos = torch.cat([q_pos, q_pos.new_full((b, nqp - nq), QUERY_PAD_POS)], dim=1)
    # Rows ordered (query, head in group) under each KV head, as in `tile_partials`.
    q_rows = qf.view(b, nqp, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, nqp * g, d)
    tile_min = kps.amin(-1).amin(0)  # [Kt]: a block needs a tile if some row may see one of its keys
    # Query blocks of one key tile's worth (measured fastest: a causal block then computes only its own
    # diagonal tile's masked half in vain), fewer where the scores would not fit the budget.
    block = max(step, min(-(-tile // step) * step, SCORE_BUDGET // max(1, b * hkv * g * kt * tile) // step * step))
    out = []
    for q0 in range(0, nqp, block):
        q1 = min(nqp, q0 + block)
        seen = (tile_min <= q_pos[:, q0:q1].max()).nonzero()
        n = int(seen[-1]) + 1 if seen.numel() else 1
        rows = (q1 - q0) * g
        a = q_rows[:, q0 * g : q1 * g].contiguous()
        keys = ks if n == kt else ks[..., : n * tile].contiguous()
        s = torch.bmm(a, keys.view(b * hkv, d, n * tile)).view(b, hkv, rows, n, tile)
        inplace = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        s = s.mul_(scale) if inplace else s * scale
        row_pos = q_pos[:, q0:q1, None].expand(b, q1 - q0, g).reshape(b, 1, rows, 1, 1)
        hidden = kps[:, None, None, :n] > row_pos
        s = s.masked_fill_(hidden, NEG_INF) if inplace else s.masked_fill(hidden, NEG_INF)
        m = s.amax(dim=-1)  # [B, Hkv, rows, n]
        p = s.sub_(_safe(m).unsqueeze(-1)).exp_() if inplace else torch.exp(s - _safe(m).unsqueeze(-1))
        l = p.sum(dim=-1)  # noqa: E741
        # Tile-major, so the merge reads each tile's accumulator contiguously.
        p_tiles = p.permute(3, 0, 1, 2, 4).reshape(n * b * hkv, rows, tile).contiguous()
        acc = torch.bmm(p_tiles, vs[:n].view(n * b * hkv, tile, d)).view(n, b, hkv, rows, d)
        parts = AttnPartial(m.permute(3, 0, 1, 2).contiguous(), l.permute(3, 0, 1, 2).contiguous(), acc)
        out.append(finalize(merge_tiles(parts), q.dtype))  # [B, Hkv, rows, D]
    o = torch.cat(out, dim=2) if len(out) > 1 else out[0]
    return o.view(b, hkv, nqp, g, d).permute(0, 2, 1, 3, 4).reshape(b, nqp, hq, d)[:, :nq]


def _key_tiles(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tile: int):
    """Keys [B, Nk, Hkv, D] -> fp32 k [B, Hkv, D, Kt*T] and v [Kt, B, Hkv, T, D] (the upcast is exact),
    positions [B, Kt, T]; padded with zero k/v at KEY_PAD_POS."""
    b, nk, hkv, d = k.shape
    kt = max(1, -(-nk // tile))
    extra = kt * tile - nk
    if extra:
        k = torch.cat([k, k.new_zeros(b, extra, hkv, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, extra, hkv, d)], dim=1)
        k_pos = torch.cat([k_pos, k_pos.new_full((b, extra), KEY_PAD_POS)], dim=1)
    ks = k.float().permute(0, 2, 3, 1).contiguous()
    vs = v.float().view(b, kt, tile, hkv, d).permute(1, 0, 3, 2, 4).contiguous()
    return ks, vs, k_pos.reshape(b, kt, tile), kt
