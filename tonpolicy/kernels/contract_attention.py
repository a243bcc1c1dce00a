"""Split-KV causal attention with a fixed key tile, the `contract` way.

Every query's result is built from key tiles of exactly `tile` keys. For one tile the partial is
(m, l, acc): m = max of the scaled scores (exact), p = exp(s - m) (masked keys give exactly 0),
l = last-dim sum of p over `tile` values, acc = p @ v. Scores and p @ v are fixed-shape GEMMs
([row_tile, D] x [D, tile] and [row_tile, tile] x [tile, D]) batched by one `torch.bmm`, whose
per-matrix result was measured invariant to the batch count, the thread count, and the position of
the query inside its row tile. Partials are merged left to right in key order by `merge`; a fully
masked tile is an exact no-op, so prefill (all tiles), decode (tiles up to the cache length) and
chunked prefill give the same bits. `torch.exp` is used (its scalar tail and vector paths agreed on
millions of inputs); `torch.sigmoid`/`silu` are avoided because theirs do not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tonpolicy.kernels.base import AttnPartial

# Position given to padded keys: larger than any query, so the causal mask removes them.
KEY_PAD_POS = 2**62
# Position given to padded queries: smaller than any key, so they see nothing (their rows are dropped).
QUERY_PAD_POS = -1


def _safe(m: torch.Tensor) -> torch.Tensor:
    # A fully masked row has m = -inf; subtract 0 instead so exp(-inf - 0) = 0, never NaN.
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


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
    return (p.acc / p.l.unsqueeze(-1)).to(dtype)


def _pad_dim(x: torch.Tensor, dim: int, size: int, value: float | int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype)], dim=dim)


def tile_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tile: int,
    row_tile: int,
) -> tuple[AttnPartial, int]:
    """Per-tile partials for a batch of sequences.

    q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D] with Nk a multiple of `tile`; q_pos [B, Nq], k_pos [B, Nk].
    Returns partials with m/l [B, Hq, Qp, Kt] and acc [B, Hq, Qp, Kt, D] (Qp = Nq padded to row_tile),
    and Nq.
    """
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    if nk % tile:
        raise ValueError(f"key count {nk} is not a multiple of the tile {tile}")
    g = hq // hkv
    kt = nk // tile
    qt = max(1, -(-nq // row_tile))
    qp = qt * row_tile
    qf = _pad_dim(q.float(), 1, qp, 0.0)
    qpos = _pad_dim(q_pos, 1, qp, QUERY_PAD_POS)
    # [B, Hq, Qt, rt, D] and keys [B, Hq, Kt, T, D] (GQA: each KV head serves g query heads).
    qf = qf.permute(0, 2, 1, 3).reshape(b, hq, qt, row_tile, d)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1).reshape(b, hq, kt, tile, d)
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1).reshape(b, hq, kt, tile, d)
    shape = (b, hq, qt, kt)
    qa = qf.unsqueeze(3).expand(*shape, row_tile, d).reshape(-1, row_tile, d)
    ka = kf.transpose(-1, -2).unsqueeze(2).expand(*shape, d, tile).reshape(-1, d, tile)
    s = torch.bmm(qa, ka).view(*shape, row_tile, tile) * scale
    visible = k_pos.view(b, 1, 1, kt, 1, tile) <= qpos.view(b, 1, qt, 1, row_tile, 1)
    s = torch.where(visible, s, torch.full_like(s, float("-inf")))
    m = s.amax(dim=-1)
    p = torch.exp(s - _safe(m).unsqueeze(-1))
    l = p.sum(dim=-1)  # noqa: E741
    va = vf.unsqueeze(2).expand(*shape, tile, d).reshape(-1, tile, d)
    acc = torch.bmm(p.reshape(-1, row_tile, tile), va).view(*shape, row_tile, d)
    # -> [B, Hq, Qp, Kt(, D)]: queries flattened back, tiles last for the key-order merge.
    m = m.permute(0, 1, 2, 4, 3).reshape(b, hq, qp, kt)
    l = l.permute(0, 1, 2, 4, 3).reshape(b, hq, qp, kt)  # noqa: E741
    acc = acc.permute(0, 1, 2, 4, 3, 5).reshape(b, hq, qp, kt, d)
    return AttnPartial(m, l, acc), nq


def merge_tiles(p: AttnPartial) -> AttnPartial:
    """Left-to-right `merge` over the tile axis (m/l [..., Kt], acc [..., Kt, D]).

    Bitwise equal to folding `merge` tile by tile: the running max is an exact cummax, and the
    factors exp(M_prev - M) and exp(m_t - M) are the very values `merge` would compute."""
    kt = p.m.shape[-1]
    run_m = torch.cummax(p.m, dim=-1).values
    prev_m = torch.cat([p.m[..., :1], run_m[..., :-1]], dim=-1)
    ms = _safe(run_m)
    ca = torch.exp(prev_m - ms)
    cb = torch.exp(p.m - ms)
    lb = p.l * cb
    ab = p.acc * cb.unsqueeze(-1)
    l_run, a_run = p.l[..., 0], p.acc[..., 0, :]
    for t in range(1, kt):
        l_run = l_run * ca[..., t] + lb[..., t]
        a_run = a_run * ca[..., t].unsqueeze(-1) + ab[..., t, :]
    return AttnPartial(run_m[..., -1], l_run, a_run)


def pad_keys(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tile: int):
    """Pad the key axis (dim 1 of [B, Nk, H, D]) to a tile multiple: zero k/v, KEY_PAD_POS positions."""
    nk = k.shape[1]
    nkp = max(1, -(-nk // tile)) * tile
    if nkp == nk:
        return k, v, k_pos
    extra = nkp - nk
    k = F.pad(k, (0, 0, 0, 0, 0, extra))
    v = F.pad(v, (0, 0, 0, 0, 0, extra))
    return k, v, _pad_dim(k_pos, 1, nkp, KEY_PAD_POS)


def attention_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    tile: int,
    row_tile: int,
) -> torch.Tensor:
    """q [B, Nq, Hq, D] over k/v [B, Nk, Hkv, D] -> [B, Nq, Hq, D] in q.dtype."""
    k, v, k_pos = pad_keys(k, v, k_pos, tile)
    parts, nq = tile_partials(q, k, v, q_pos, k_pos, scale, tile, row_tile)
    out = finalize(merge_tiles(parts), q.dtype)  # [B, Hq, Qp, D]
    return out[:, :, :nq].permute(0, 2, 1, 3)
