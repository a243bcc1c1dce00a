"""Contract v2's GEMM weights in the kernels' panel layout, packed once per weight and kept while it is
unchanged (the packing moves no bit: it is the same values in another order)."""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tonpolicy.kernels import weight_cache

PANEL = 16  # lanes of a packed weight panel (every path)

# Packed weights: fp32 [N/16][K][16]; bf16 [N/16][C][Ks2][16][2] pairs (each shard padded to even, so with
# K/C even the layout is [N/16][K/2][16][2] for any C). Cached per weight in a WeakIdKeyDictionary while the
# weight's storage, version, shape, stride and dtype and the weights generation
# (tonpolicy.kernels.weight_cache) are unchanged. `_front` finds the same entries by id(w) faster than the
# dictionary's lookup (a decode step's tiny GEMMs feel it); an entry found there is used only if its weak
# reference is still w, and it leaves with w.
_packed = WeakIdKeyDictionary()
_front: dict[int, _Entry] = {}


class _Entry:
    __slots__ = ("ref", "key", "packs", "__weakref__")

    def __init__(self) -> None:
        self.ref, self.key, self.packs = None, None, {}


def _entry(w: torch.Tensor) -> _Entry:
    e = _front.get(id(w))
    if e is not None and e.ref() is w:
        return e
    e = _packed.get(w)
    if e is None:
        e = _Entry()
        try:
            _packed[w] = e
        except TypeError:  # not weak-referenceable: no caching
            return e
        ident = id(w)
        e.ref = weakref.ref(w, lambda _r: _front.pop(ident, None))
    _front[id(w)] = e
    return e


def _layout(w: torch.Tensor, num_shards: int) -> int:
    """Which packing w needs: bf16 with odd shards pads each shard (the shard count matters), else 1."""
    return num_shards if w.dtype == torch.bfloat16 and (w.shape[1] // num_shards) % 2 else 1


def pack_weight(w: torch.Tensor, num_shards: int = 1) -> torch.Tensor:
    """w [N, K] in the kernels' panel layout (a new tensor in w's dtype)."""
    n, k = w.shape
    np_ = -(-n // PANEL)
    w = w.detach()
    if w.dtype == torch.float32:
        wp = w.new_zeros(np_ * PANEL, k)
        wp[:n] = w
        return wp.view(np_, PANEL, k).transpose(1, 2).contiguous()
    c = _layout(w, num_shards)
    ks = k // c
    ks2 = -(-ks // 2)
    wp = w.new_zeros(np_ * PANEL, c, 2 * ks2)
    wp[:n, :, :ks] = w.reshape(n, c, ks)
    return wp.view(np_, PANEL, c, ks2, 2).permute(0, 2, 3, 1, 4).contiguous()


def packed_weight(w: torch.Tensor, num_shards: int) -> torch.Tensor:
    """w packed for `num_shards` K-shards, from the cache while w is unchanged."""
    layout = 1 if num_shards == 1 else _layout(w, num_shards)
    e = _front.get(id(w))
    if e is None or e.ref() is not w:
        e = _entry(w)
    key = (w._version, w.data_ptr(), weight_cache.generation(), w.shape, w.stride(), w.dtype)
    if e.key != key:
        e.key, e.packs = key, {}
    got = e.packs.get(layout)
    if got is None:
        e.packs[layout] = got = pack_weight(w, layout)
    return got
