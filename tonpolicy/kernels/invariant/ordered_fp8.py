"""The block-scaled FP8 linear of contract.quant=fp8_block on the ordered (v2) set, built from the ordered
chains, so its bits are IEEE's and the source's (docs/REDUCTION_RULES.md, contract.quant=fp8_block).

y[m, n] for x [M, K] against W [N, K], K-groups b = 0 .. KB-1 of 128 (the last may be partial):
- (qa, sa) = the activation quantization of x (per token, groups of 128), (qw, sw) = the weight's (128 x 128
  blocks; sw[n, b] is the scale of the block that holds row n);
- S_b[m, n] = v2's bf16 pair chain over group b of qa[m, k] * qw[n, k] from +0 (e4m3 values are bf16 values
  exactly, and their products are exact in fp32: the chain rounds only its sums, in the source's order);
- t_b[m, n] = sa[m, b] * sw[n, b], one fp32 rounding;
- y = +0, then for b ascending: y = y + S_b[m, n] * t_b[m, n], the product and the sum each one fp32 rounding
  (no FMA: two IEEE operations, round to nearest even, gradual underflow: a process whose threads flush
  subnormals is refused at each call, `float_mode`).
So a row's bits depend on that row and the weight alone. The weight blocks are each Hugging Face weight's
(`RowParts`: a fused weight's rows quantized per HF weight, a TP rank's rows in its HF weight's blocks, a
block split across ranks scaled by the whole block's amax, which the caller's `reduce_amax` supplies).
A row-parallel linear's canonical K-shard c is the
same expression over that shard alone: its weight blocks, activation groups and group chain start at the
shard's first column (a shard that is a multiple of 128 wide holds the unsharded linear's own blocks), its
partials summed as every other set's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tonpolicy.kernels import weight_cache
from tonpolicy.kernels.fp8_block import (
    BLOCK,
    quantize_activation_groups,
    quantize_weight_blocks,
    touched_blocks,
    weight_block_amax,
)
from tonpolicy.kernels.invariant import float_mode, ordered_gemm


@dataclass
class QuantizedWeight:
    """A weight quantized for the GEMM: its e4m3 values as bf16 (exact) in the whole K-groups `full` [N, 128 g]
    and the partial last group `tail` [N, K mod 128] (each contiguous, None when empty: the ordered GEMM's
    packed-weight cache keys on them), and per-row scales [N, KB] fp32."""

    full: torch.Tensor | None
    tail: torch.Tensor | None
    row_scales: torch.Tensor


@dataclass(frozen=True)
class RowParts:
    """Where a weight's rows come from, in order: per part (rows here, the first one's row in its HF weight,
    that HF weight's rows). A fused [q; k; v] or [gate; up] is one part per HF weight, a TP rank's shard of
    them the rank's slice of each. Blocks never straddle two parts."""

    parts: tuple[tuple[int, int, int], ...]

    @staticmethod
    def whole(*sizes: int) -> RowParts:
        return RowParts(tuple((s, 0, s) for s in sizes))

    @staticmethod
    def tp_shard(sizes: tuple[int, ...] | list[int], rank: int, tp: int) -> RowParts:
        """Rank `rank` of `tp` holding the rank-th equal slice of each HF weight, fused in order."""
        for s in sizes:
            if s % tp:
                raise ValueError(f"fp8_block: a weight of {s} rows does not split over TP {tp}")
        return RowParts(tuple((s // tp, rank * (s // tp), s) for s in sizes))

    @property
    def rows(self) -> int:
        return sum(p[0] for p in self.parts)

    def splits_blocks(self) -> bool:
        """Some part holds a block only in part (the same answer on every rank of an equal split)."""
        return any(n % BLOCK and n != total for n, _, total in self.parts)


# reduce_amax(t) -> t's elementwise max over every rank holding a part of the same weights (in place or
# returned): the trainer's all-reduce MAX over its TP group. Exact in any order.
AmaxReduce = Callable[[torch.Tensor], torch.Tensor | None]


def _block_amax(w: torch.Tensor, rows: RowParts, reduce_amax: AmaxReduce | None) -> list[torch.Tensor | None]:
    """Each part's touched blocks' whole-block amax, where a reduce is needed (None: the part's own)."""
    if reduce_amax is None or not rows.splits_blocks():
        return [None] * len(rows.parts)
    kb = -(-w.shape[1] // BLOCK)
    grids, at = [], 0
    for n, first, total in rows.parts:
        grid = torch.zeros(-(-total // BLOCK), kb, dtype=torch.float32, device=w.device)
        b, nb = touched_blocks(n, first, BLOCK)
        grid[b : b + nb] = weight_block_amax(w[at : at + n], BLOCK, first)
        grids.append(grid)
        at += n
    flat = torch.cat([g.reshape(-1) for g in grids])
    got = reduce_amax(flat)
    flat = flat if got is None else got
    out, at = [], 0
    for (n, first, _), g in zip(rows.parts, grids, strict=True):
        whole = flat[at : at + g.numel()].reshape(g.shape)
        b, nb = touched_blocks(n, first, BLOCK)
        out.append(whole[b : b + nb])
        at += g.numel()
    return out


def quantize_weight(
    w: torch.Tensor, rows: RowParts | None = None, reduce_amax: AmaxReduce | None = None
) -> QuantizedWeight:
    """w [N, K] quantized per part of `rows` (default: w is one HF weight)."""
    rows = rows if rows is not None else RowParts.whole(w.shape[0])
    if rows.rows != w.shape[0]:
        raise ValueError(f"fp8_block: row parts {rows.parts} hold {rows.rows} rows, the weight {w.shape[0]}")
    qs, scales, at = [], [], 0
    for (n, first, _), amax in zip(rows.parts, _block_amax(w, rows, reduce_amax), strict=True):
        q, scale_inv = quantize_weight_blocks(w[at : at + n], BLOCK, row_offset=first, amax=amax)
        qs.append(q)
        # Row r of the part lies in its HF weight's block (first + r) // BLOCK, the first touched one's index.
        scales.append(scale_inv.index_select(0, (torch.arange(n, device=w.device) + first % BLOCK) // BLOCK))
        at += n
    values = torch.cat(qs).to(torch.bfloat16)
    cut = w.shape[1] // BLOCK * BLOCK
    full = values[:, :cut].contiguous() if cut else None
    tail = values[:, cut:].contiguous() if cut < w.shape[1] else None
    return QuantizedWeight(full, tail, torch.cat(scales).contiguous())


class _Entry:
    __slots__ = ("key", "ref", "shards")

    def __init__(self, w: torch.Tensor) -> None:
        self.ref = weakref.ref(w)
        self.key: tuple | None = None
        self.shards: dict[tuple[int, RowParts | None], list[QuantizedWeight]] = {}


_cache: dict[int, _Entry] = {}


def cached_weight(
    w: torch.Tensor, num_shards: int, rows: RowParts | None = None, reduce_amax: AmaxReduce | None = None
) -> list[QuantizedWeight]:
    """w's canonical K-shards, each quantized on its own (its rows per `rows`), from the cache while w is
    unchanged (its storage, version and the weights generation). With `reduce_amax`, every rank holding
    part of w's blocks must miss together: they hold the same weights version."""
    e = _cache.get(id(w))
    if e is None or e.ref() is not w:
        e = _cache[id(w)] = _Entry(w)
        for k in [k for k, v in _cache.items() if v.ref() is None]:
            del _cache[k]
    key = (w._version, w.data_ptr(), weight_cache.generation(), w.shape, w.stride(), w.dtype)
    if e.key != key:
        e.key, e.shards = key, {}
    got = e.shards.get((num_shards, rows))
    if got is None:
        width = w.shape[1] // num_shards
        d = w.detach()
        got = e.shards[(num_shards, rows)] = [
            quantize_weight(d[:, c * width : (c + 1) * width], rows, reduce_amax) for c in range(num_shards)
        ]
    return got


def _check_shards(k: int, num_shards: int) -> None:
    if num_shards < 1 or k % num_shards:
        raise ValueError(f"fp8_block: K={k} does not split into {num_shards} canonical shards")


def _group_sums(qa: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """S [KB, M, N]: each K-group's pair chain from +0 (qa: e4m3 values as bf16). The whole groups are one
    call's K-shards (the ordered GEMM starts each shard's chain at +0), the partial group its own call."""
    parts = []
    if w.full is not None:
        cut = w.full.shape[1]
        parts.append(ordered_gemm.linear_partials(qa[:, :cut].contiguous(), w.full, cut // BLOCK))
    if w.tail is not None:
        parts.append(ordered_gemm.linear(qa[:, qa.shape[1] - w.tail.shape[1] :].contiguous(), w.tail)[None])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scaled_chain(sums: torch.Tensor, sa: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The K-group chain: y = +0; y = y + S_b * (sa_b * sw_b) over b ascending, every operation one IEEE
    fp32 rounding (separate torch ops: nothing fuses them into an FMA). sums [G, M, N], sa [M, G], sw [N, G]."""
    terms = sums * (sa.t()[:, :, None] * sw.t()[:, None, :])  # every group's S_b * t_b at once: same roundings
    y = torch.zeros(sums.shape[1:], dtype=torch.float32)
    for b in range(sums.shape[0]):
        y = y + terms[b]
    return y


def fp8_linear_partials(
    x: torch.Tensor,
    w: torch.Tensor,
    num_shards: int,
    rows: RowParts | None = None,
    reduce_amax: AmaxReduce | None = None,
) -> torch.Tensor:
    """fp32 [C, *lead, N]: x [..., K] (bf16/fp32) against the master weight w [N, K], quantized by the
    contract's rule (per part of `rows`), per canonical K-shard (each shard its own K-group chain from +0)."""
    k, n = x.shape[-1], w.shape[0]
    if w.shape[-1] != k:
        raise ValueError(f"fp8_block: x [..., {k}] and w {tuple(w.shape)} do not contract")
    _check_shards(k, num_shards)
    if x.device.type == "cpu":  # the combine's torch ops run under this process's MXCSR
        float_mode.require_gradual_underflow("contract.quant=fp8_block")
    lead = x.shape[:-1]
    x2 = x.detach().reshape(-1, k)
    shards = cached_weight(w, num_shards, rows, reduce_amax)
    out = torch.empty(num_shards, x2.shape[0], n, dtype=torch.float32)
    width = k // num_shards
    for c, qw in enumerate(shards):
        if not (x2.shape[0] and n):
            break
        q, sa = quantize_activation_groups(x2[:, c * width : (c + 1) * width], BLOCK)
        out[c] = _scaled_chain(_group_sums(q.to(torch.bfloat16), qw), sa, qw.row_scales)
    return out.reshape(num_shards, *lead, n)


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, rows: RowParts | None = None, reduce_amax: AmaxReduce | None = None
) -> torch.Tensor:
    """fp32 [*lead, N]: the fp8 linear with K whole (column-parallel linears)."""
    return fp8_linear_partials(x, w, 1, rows, reduce_amax)[0]


def plain_fp8_linear(x: torch.Tensor, w: torch.Tensor, rows: RowParts | None = None) -> torch.Tensor:
    """The control: the same quantized operands dequantized and multiplied by torch (fp32 F.linear): close
    to `fp8_linear`, not its bits (the library's sum order and no K-group chain)."""
    q, sa = quantize_activation_groups(x, BLOCK)
    k = x.shape[-1]
    xd = (q.to(torch.float32) * sa.repeat_interleave(BLOCK, -1)[..., :k]).reshape(x.shape)
    qw = quantize_weight(w, rows)
    values = torch.cat([v for v in (qw.full, qw.tail) if v is not None], dim=1)
    wd = values.float() * qw.row_scales.repeat_interleave(BLOCK, -1)[:, :k]
    return torch.nn.functional.linear(xd, wd)
