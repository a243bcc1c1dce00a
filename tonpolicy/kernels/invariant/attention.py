"""Split-KV causal attention with a fixed key tile, the `invariant` way.

Every query's result is built from key tiles of exactly `tile` keys. For one tile the partial is
(m, l, acc): m = max of the scaled scores (exact), p = exp(s - m) (masked keys give exactly 0),
l = last-dim sum of p over `tile` values, acc = p @ v. Partials are merged left to right in key order by
`merge`. All in fp32 (bf16 keys/values are upcast, exactly).

The GEMMs: a block of queries (rows ordered (query, head in group) under each KV head) gets its scores
for all the key tiles it may see in one GEMM, [rows, D] x [D, tiles * T], and each tile's p @ v in one
batched GEMM, [rows, T] x [T, D]. Both are the contract GEMM (exact_gemm): each score's and each
accumulator's bits depend on its row and the keys alone, not on the GEMM's row count, column count, batch
count or thread count (tests/kernels/test_kernels_attention.py), so prefill, decode, chunked prefill, any
batch and any block size give the same bits; decode computes only its real query rows (`trim_rows`),
scores and p @ v alike (queries are still padded to the `granule` for the plan). A tile no query of a
block sees gives exactly (m=-inf, l=0, acc=0), and merging it is an exact no-op (up to the sign of an
all-zero accumulator), so tiles past the last one a block may see are left out, as decode leaves out the
tiles past its cache. `torch.exp` is used (its scalar-tail and vector paths agreed on millions of
inputs); `sigmoid`/`silu` are avoided (they do not).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tonpolicy.kernels import attention_merge

# The shared partials and the key tiles, imported from here by their callers too.
from tonpolicy.kernels.attention_merge import KEY_PAD_POS as KEY_PAD_POS
from tonpolicy.kernels.attention_merge import QUERY_PAD_POS, safe_max
from tonpolicy.kernels.attention_merge import finalize as finalize
from tonpolicy.kernels.base import AttnPartial
from tonpolicy.kernels.invariant import exact_gemm
from tonpolicy.kernels.invariant.attention_keys import Keys, KeyTiles, PooledKeyTiles
from tonpolicy.kernels.invariant.attention_keys import key_tiles as key_tiles

NEG_INF = float("-inf")
# Operand dtypes whose products are exact in fp32 (8- and 11-bit significands).
LOW_PRECISION = (torch.bfloat16, torch.float16)
# Scores of one query block held at once (fp32 elements): bounds memory for long sequences.
SCORE_BUDGET = 1 << 23
# Largest per-tile accumulator (elements) whose fold carries l beside acc (fewer, larger ops: faster
# when ops are small; measured slower for prefill-sized blocks, where the concatenation costs more).
FOLD_TOGETHER = 1 << 14
# Work per query block (sequences x query heads x head dim) at which one key tile of queries is best.
BLOCK_WORK = 4096


def merge(a: AttnPartial, b: AttnPartial, products: Products | None = None) -> AttnPartial:
    """The one merge formula (kernels.attention_merge) with the products' exp; `a` covers keys before `b`."""
    return attention_merge.merge(a, b, (products or EXACT).exp)


def merge_tiles(p: AttnPartial, inplace: bool = False, products: Products | None = None) -> AttnPartial:
    """Left-to-right `merge` over the tile axis, which is dim 0 (m/l [Kt, ...], acc [Kt, ..., D]).

    Bitwise equal to folding `merge` tile by tile: the running max is an exact cummax, and the
    factors exp(M_prev - M) and exp(m_t - M) are the very values `merge` would compute. `inplace`
    (nothing is differentiated; `p`'s buffers are the caller's to overwrite) folds in place: the same
    ops, the same bits."""
    kt = p.m.shape[0]
    if kt == 1:
        return AttnPartial(p.m[0], p.l[0], p.acc[0])
    exp = (products or EXACT).exp
    run_m = torch.cummax(p.m, dim=0).values
    prev_m = torch.cat([p.m[:1], run_m[:-1]], dim=0)
    ms = safe_max(run_m)
    ca = exp(prev_m - ms)
    cb = exp(p.m - ms)
    if inplace and p.acc[0].numel() <= FOLD_TOGETHER:
        # Small partials (decode): l as column 0 beside acc, so each tile costs two ops, not four.
        la = torch.cat([p.l.unsqueeze(-1), p.acc], dim=-1).mul_(cb.unsqueeze(-1))
        # unbind: every tile's view in one call (long contexts have hundreds of tiles per layer)
        ca_la, la_t = ca.unsqueeze(-1).unbind(0), la.unbind(0)
        run = la_t[0]
        for t in range(1, kt):
            run.mul_(ca_la[t]).add_(la_t[t])
        return AttnPartial(run_m[-1], run[..., 0], run[..., 1:])
    if inplace:  # the partials are this call's own buffers: scaled where they lie
        lb, ab = p.l.mul_(cb).unbind(0), p.acc.mul_(cb.unsqueeze(-1)).unbind(0)
    else:
        lb, ab = (p.l * cb).unbind(0), (p.acc * cb.unsqueeze(-1)).unbind(0)
    ca_l, ca_acc = ca.unbind(0), ca.unsqueeze(-1).unbind(0)
    l_run, a_run = lb[0], ab[0]
    for t in range(1, kt):
        if inplace:
            l_run.mul_(ca_l[t]).add_(lb[t])
            a_run.mul_(ca_acc[t]).add_(ab[t])
        else:
            l_run = l_run * ca_l[t] + lb[t]
            a_run = a_run * ca_acc[t] + ab[t]
    return AttnPartial(run_m[-1], l_run, a_run)


@dataclass
class _Span:
    """Key tiles [a, b) of a block's partials; scores from tile `mask_from` (relative to a) on are masked
    by `mask` [B, 1, R, b - a - mask_from, T] (True: the key is hidden from the row), or, in place, by
    `bias` (0 or -inf, added) and `keep` (1 or 0, multiplied); all None: no key is hidden."""

    a: int
    b: int
    mask_from: int
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    keep: torch.Tensor | None = None


@dataclass
class _Block:
    q0: int  # padded queries [q0, q1)
    q1: int
    spans: list[_Span]
    # Rows of real queries (a prefix of the block's rows; the rest pad the p @ v GEMM to the granule).
    # In place, the scores and the softmax are computed for these rows only (masks cover only them).
    real: int


class Products(NamedTuple):
    """The attention's ops under a contract: its two GEMMs, `scores(rows, q_dtype, k, k_dtype)` (rows
    [B, R, D] x k [B, D, N] over the head dim) and `pv(p, v, v_dtype)` (p [B, R, T] x v [B, T, D] over a
    key tile), both fp32 (the dtypes name where the upcast values come from); and its row-local ops on fp32:
    `exp` (differentiable), `exp_` (in place, nothing differentiated) and `row_sum` over the last dim.
    Optional, for nothing differentiated: `softmax_tiles(s, heads, tile, scale, mask_from, keep)` and
    `merge_finalize(parts, dtype)`, each the bits of the in-place steps below in one call.
    `upcasts_operands`: both GEMMs take bf16 key tiles as they are and upcast them exactly themselves (so a
    pooled span is copied in its own dtype)."""

    scores: Callable[[torch.Tensor, torch.dtype, torch.Tensor, torch.dtype], torch.Tensor]
    pv: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp
    exp_: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.exp_
    row_sum: Callable[[torch.Tensor], torch.Tensor] = lambda p: p.sum(dim=-1)  # noqa: E731
    softmax_tiles: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    merge_finalize: Callable[[AttnPartial, torch.dtype], torch.Tensor] | None = None
    upcasts_operands: bool = False


# Contract v1's: the exact fixed-point products; torch's exp and sum (probed on each host).
EXACT = Products(
    scores=lambda rows, q_dtype, k, k_dtype: exact_gemm.matmul_as(rows, q_dtype, k, k_dtype, short_k=True),
    pv=exact_gemm.pv_product,
)


@dataclass
class Plan:
    """What an attention call computes where: everything that depends only on the positions and the key
    set's geometry, not on q/k/v values, so calls with the same geometry (every layer of a decode step)
    share one (`InvariantKernels.attention_pooled` keeps them by geometry)."""

    nqp: int  # queries padded so that a block's row count is a multiple of the granule
    blocks: list[_Block]
    whole: bool  # pooled keys upcast at once (several blocks would each read them)
    inplace: bool
    trim: bool  # scores and softmax of the real rows only (`trim_rows`)


def plan_attention(
    q_shape: torch.Size, q_pos: torch.Tensor, keys: Keys, granule: int, inplace: bool, trim: bool = False
) -> Plan:
    """The plan of `attention(q, q_pos, keys, ...)` for q of `q_shape` [B, Nq, Hq, D]; `trim`: as
    `trim_rows` says for the call."""
    b, nq, hq, d = q_shape
    g = hq // keys.heads
    step = granule // math.gcd(g, granule)
    nqp = -(-nq // step) * step
    if nqp != nq:
        q_pos = torch.cat([q_pos, q_pos.new_full((b, nqp - nq), QUERY_PAD_POS)], dim=1)
    bounds = _blocks(nqp, step, keys, g, b, d)
    whole = len(bounds) > 1 and isinstance(keys, PooledKeyTiles)
    chunk = KeyTiles.chunk if whole else keys.chunk
    tile_min = keys.pos.amin(-1).amin(0)  # [Kt]: a block needs a tile if some row may see one of its keys
    blocks = []
    for q0, q1 in bounds:
        row_pos = q_pos[:, q0:q1, None].expand(b, q1 - q0, g).reshape(b, -1)
        seen = (tile_min <= row_pos.max()).nonzero()
        n = int(seen[-1]) + 1 if seen.numel() else 1
        ends = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
        real = (q1 - q0) * g
        if trim:  # the real queries' rows, and never a lone row (`trim_rows`)
            real = min(real, max(max(0, min(q1, nq) - q0) * g, MIN_TRIMMED_ROWS))
        spans = [_mask(row_pos[:, :real], keys.pos[:, a:e], a, e, inplace) for a, e in ends]
        blocks.append(_Block(q0, q1, spans, real))
    return Plan(nqp, blocks, whole, inplace, trim)


def _mask(row_pos: torch.Tensor, kpos: torch.Tensor, a: int, b: int, inplace: bool) -> _Span:
    bs, r = row_pos.shape
    j = 0
    if inplace:
        # Mask from the first tile that hides a key from some row on: masking a score every row sees is a
        # no-op, so the tiles before it are skipped (the same bits, a fraction of the work).
        hides = (kpos.amax(-1) > row_pos.amin(-1, keepdim=True)).any(0).nonzero()
        if not hides.numel():
            return _Span(a, b, 0)
        j = int(hides[0])
    mask = kpos[:, None, None, j:] > row_pos.view(bs, 1, r, 1, 1)
    if not inplace:
        return _Span(a, b, j, mask)
    bias = torch.zeros(mask.shape, device=mask.device).masked_fill_(mask, NEG_INF)
    return _Span(a, b, j, bias=bias, keep=(~mask).float())


def _query_rows(q: torch.Tensor, heads: int, nqp: int) -> torch.Tensor:
    """q [B, Nq, Hq, D] -> fp32 rows [B*Hkv, Nqp*G, D] ordered (query, head in group), padded with zero
    queries to Nqp (their positions see nothing)."""
    b, nq, hq, d = q.shape
    g = hq // heads
    qf = q.float()
    if nqp != nq:
        qf = torch.cat([qf, qf.new_zeros(b, nqp - nq, hq, d)], dim=1)
    return qf.view(b, nqp, heads, g, d).permute(0, 2, 1, 3, 4).reshape(b * heads, nqp * g, d)


def _block_partials(
    rows: torch.Tensor,
    keys: Keys,
    blk: _Block,
    scale: float,
    inplace: bool,
    q_dtype: torch.dtype,
    products: Products,
) -> AttnPartial:
    """Partials of query rows [B*Hkv, R, D] over the block's key tiles, tile-major: m/l [n, B*Hkv, R'],
    acc [n, B*Hkv, R', D] (R' = R, or in place the block's real rows). Spans of `keys.chunk` tiles give
    the same bits as one span (a score's bits do not depend on the GEMM's column count)."""
    rows_real = rows[:, : blk.real].contiguous() if blk.real < rows.shape[1] else rows
    spans = [_span_partials(rows_real, keys, sp, scale, inplace, q_dtype, products) for sp in blk.spans]
    if len(spans) == 1:
        return spans[0]
    return AttnPartial(*(torch.cat([getattr(p, f) for p in spans]) for f in ("m", "l", "acc")))


def _span_partials(
    rows: torch.Tensor,
    keys: Keys,
    sp: _Span,
    scale: float,
    inplace: bool,
    q_dtype: torch.dtype,
    products: Products,
) -> AttnPartial:
    """Scores of `rows` (every row of the GEMM a real query's: the score GEMM's row bits were measured
    independent of its row count down to 1 row, tests/kernels/test_kernels_attention.py), softmax partials, and
    p @ v of the same rows (the contract GEMM gives a row the same bits at any row count: no padding)."""
    bh, r, d = rows.shape
    t, n = keys.tile, sp.b - sp.a
    k, v = keys.span(sp.a, sp.b, upcast=not products.upcasts_operands)
    s = products.scores(rows, q_dtype, k, keys.source_dtype)  # over the head dim
    j = sp.mask_from
    if inplace and products.softmax_tiles is not None:
        p_tiles, m, l = products.softmax_tiles(s, keys.heads, t, scale, j, sp.keep)  # noqa: E741
        acc = products.pv(p_tiles, v.reshape(n * bh, t, d), keys.source_dtype).view(n, bh, r, d)
        return AttnPartial(m, l, acc)
    s = s.view(-1, keys.heads, r, n, t)  # [B, Hkv, R, n, T]
    if not inplace:
        s = s * scale
        if sp.mask is not None:
            s = s.masked_fill(sp.mask, NEG_INF)
        m = s.amax(dim=-1)  # [B, Hkv, R, n]
        p = products.exp(s - safe_max(m).unsqueeze(-1))
    elif sp.bias is None:
        m = s.mul_(scale).amax(dim=-1)
        p = products.exp_(s.sub_(safe_max(m).unsqueeze(-1)))
    else:
        # The same values as masking with -inf and exp (exp(-inf) = 0), and faster: adding a 0/-inf bias
        # is cheaper than a broadcast masked_fill, and exp is slow on -inf, so hidden scores are exp'd as
        # exp(0) and multiplied by 0 (NaN and +inf still propagate).
        s.mul_(scale)[:, :, :, j:].add_(sp.bias)
        m = s.amax(dim=-1)
        p = s.sub_(safe_max(m).unsqueeze(-1))
        p[:, :, :, j:].nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)
        products.exp_(p)[:, :, :, j:].mul_(sp.keep)
    l = products.row_sum(p)  # noqa: E741
    # Tile-major, so the merge reads each tile's partials contiguously.
    p_tiles = p.permute(3, 0, 1, 2, 4).reshape(n * bh, r, t)
    acc = products.pv(p_tiles, v.reshape(n * bh, t, d), keys.source_dtype).view(n, bh, r, d)
    return AttnPartial(m.permute(3, 0, 1, 2).reshape(n, bh, r), l.permute(3, 0, 1, 2).reshape(n, bh, r), acc)


def _blocks(nqp: int, step: int, keys: Keys, g: int, batch: int, d: int):
    """Query blocks, sized for speed (any size gives the same bits). A causal block computes part of its
    last key tile in vain, and every block costs a fixed number of ops: the best size balances the two,
    about one key tile of queries when a block's work is large (16 sequences x 8 query heads of 32 dims,
    measured) and sqrt-proportionally more when it is small (one sequence: 4 tiles). Capped so the
    scores fit SCORE_BUDGET."""
    width = batch * keys.heads * g * d
    tiles = max(1, round(math.sqrt(BLOCK_WORK / width))) if width < BLOCK_WORK else 1
    block = max(step, -(-tiles * keys.tile // step) * step)
    per_query = max(1, batch * keys.heads * g * keys.tiles * keys.tile)
    block = max(step, min(block, SCORE_BUDGET // per_query // step * step))
    return [(q0, min(nqp, q0 + block)) for q0 in range(0, nqp, block)]


# The fewest rows a trimmed score GEMM takes (the contract GEMM gives a row the same bits at any count).
MIN_TRIMMED_ROWS = 1


def trim_rows(q_dtype: torch.dtype, key_dtype: torch.dtype, inplace: bool) -> bool:
    """Whether the score GEMM takes only the real queries' rows (decode: its one query's G rows, not the
    padded block): whenever nothing is differentiated. The contract GEMM's row bits do not depend on
    its row count, so this is a matter of speed only."""
    return inplace


def in_place(q: torch.Tensor, keys: Keys) -> bool:
    """Whether the scores may be overwritten in place (nothing is differentiated: same ops, same bits)."""
    return not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad))


def attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    keys: Keys,
    scale: float,
    granule: int,
    plan: Plan | None = None,
    products: Products | None = None,
) -> torch.Tensor:
    """q [B, Nq, Hq, D] at positions q_pos [B, Nq] over `keys` (from `key_tiles` or `PooledKeyTiles`)
    -> [B, Nq, Hq, D] in q.dtype. `plan`: from `plan_attention` for these positions and key geometry;
    `products`: the contract's two GEMMs (v1's exact products by default)."""
    products = products or EXACT
    b, nq, hq, d = q.shape
    heads, g = keys.heads, hq // keys.heads
    inplace = in_place(q, keys)
    trim = trim_rows(q.dtype, keys.source_dtype, inplace)
    if plan is None or plan.inplace != inplace or plan.trim != trim:
        plan = plan_attention(q.shape, q_pos, keys, granule, inplace, trim)
    if plan.whole:
        keys = keys.whole()  # upcast once, read by every block
    # Trimmed, no block reads a padded query's rows (the last block always holds a real query): none are made.
    rows = _query_rows(q, heads, nq if plan.trim else plan.nqp)
    out = []
    for blk in plan.blocks:
        r = rows[:, blk.q0 * g : blk.q1 * g].contiguous()
        parts = _block_partials(r, keys, blk, scale, inplace, q.dtype, products)
        if inplace and products.merge_finalize is not None:
            out.append(products.merge_finalize(parts, q.dtype))
        else:
            out.append(finalize(merge_tiles(parts, inplace, products), q.dtype))
    o = torch.cat(out, dim=1) if len(out) > 1 else out[0]  # [B*Hkv, Nq'*G, D]: real rows, or all
    nr = o.shape[1] // g
    return o.view(b, heads, nr, g, d).permute(0, 2, 1, 3, 4).reshape(b, nr, hq, d)[:, :nq]


def tile_partial(
    q: torch.Tensor, q_pos: torch.Tensor, keys: Keys, scale: float, granule: int, products: Products | None = None
) -> AttnPartial:
    """The partial of q [Nq, Hq, D] over one key tile (ring context parallelism merges these):
    m/l [Nq, Hq], acc [Nq, Hq, D]."""
    products = products or EXACT
    nq, hq, _ = q.shape
    heads, g = keys.heads, hq // keys.heads
    inplace = in_place(q, keys)
    plan = plan_attention(q[None].shape, q_pos[None], keys, granule, inplace)
    rows = _query_rows(q[None], heads, plan.nqp)
    parts = [  # one key tile: every block's one span covers it, seen or not
        _block_partials(rows[:, blk.q0 * g : blk.q1 * g].contiguous(), keys, blk, scale, inplace, q.dtype, products)
        for blk in plan.blocks
    ]
    m, l, acc = (torch.cat([getattr(p, f)[0] for p in parts], dim=1) for f in ("m", "l", "acc"))  # noqa: E741

    def unpack(x: torch.Tensor) -> torch.Tensor:  # [Hkv, Nq'*G(, D)] -> [Nq, Hq(, D)] (Nq': real or padded)
        nr = x.shape[1] // g
        return x.view(heads, nr, g, *x.shape[2:]).transpose(0, 1).reshape(nr, hq, *x.shape[2:])[:nq]

    return AttnPartial(unpack(m), unpack(l), unpack(acc))
