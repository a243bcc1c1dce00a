"""The split-KV attention's row-local steps in one native call each (ordered_rowwise.cpp): a span's tile
softmax partials, and the left-to-right merge of a block's tile partials with its finalisation. Each
computes the IEEE operations of the torch ops it replaces (tonpolicy.kernels.invariant.attention, with
the set's own exp and row sum) in the same order, so the same bits; what it saves is the dozens of small
ops per layer that dominate one request's decode."""

from __future__ import annotations

import torch

from tonpolicy.kernels.base import AttnPartial
from tonpolicy.kernels.invariant import ordered_rowwise
from tonpolicy.kernels.invariant.ordered_rowwise_lib import run

# Output dtypes of the merge (codes of the library's stores).
MERGE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def softmax_tiles(
    s: torch.Tensor, heads: int, tile: int, scale: float, mask_from: int, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores s [B*Hkv, R, n*T] (fp32, contiguous) -> (p [n*B*Hkv, R, T], m [n, B*Hkv, R], l [n, B*Hkv, R]),
    tile-major: x = s * scale, from tile `mask_from` on plus -inf where keep [B, 1, R, n - mask_from, T]
    is 0; m = the tile's max; p = exp(x - m) (m = -inf read as 0; hidden keys exactly 0); l = the ordered
    sum of p."""
    bh, r, nt = s.shape
    n = nt // tile
    if not s.is_contiguous() or s.dtype != torch.float32 or nt != n * tile:
        raise ValueError(f"softmax_tiles: fp32 contiguous scores [B*Hkv, R, n*{tile}] (got {tuple(s.shape)})")
    if keep is not None and (keep.dtype != torch.float32 or not keep.is_contiguous()):
        raise ValueError("softmax_tiles: keep must be a contiguous fp32 0/1 mask")
    p = torch.empty(n * bh, r, tile, dtype=torch.float32)
    m = torch.empty(n, bh, r, dtype=torch.float32)
    l = torch.empty(n, bh, r, dtype=torch.float32)  # noqa: E741
    keep_ptr = 0 if keep is None else keep.data_ptr()
    ints = (s.data_ptr(), keep_ptr, p.data_ptr(), m.data_ptr(), l.data_ptr(), bh, heads, r, n, tile, mask_from)
    run(ordered_rowwise.functions().lib, "attn_softmax", False, (*ints, torch.get_num_threads()), (scale,))
    return p, m, l


def merge_finalize(parts: AttnPartial, dtype: torch.dtype) -> torch.Tensor:
    """Tile partials m/l [Kt, N...], acc [Kt, N..., D] (fp32) -> [N..., D] in `dtype`:
    `finalize(merge_tiles(parts), dtype)`'s bits."""
    m, l, acc = (t if t.is_contiguous() else t.contiguous() for t in parts)  # noqa: E741
    code = MERGE_DTYPES.get(dtype)
    if code is None:  # another dtype: the fp32 result rounded once, as finalize rounds it
        return merge_finalize(parts, torch.float32).to(dtype)
    kt, d = acc.shape[0], acc.shape[-1]
    rows = m[0].numel()
    out = torch.empty(acc.shape[1:], dtype=dtype)
    if out.numel():
        ints = (m.data_ptr(), l.data_ptr(), acc.data_ptr(), out.data_ptr(), code, kt, rows, d)
        run(ordered_rowwise.functions().lib, "attn_merge", False, (*ints, torch.get_num_threads()))
    return out
