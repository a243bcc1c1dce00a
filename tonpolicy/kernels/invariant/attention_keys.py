"""Key tiles in the layouts of the invariant attention's GEMMs: token-major keys padded and upcast at
once (`key_tiles`), or a head-layout KV pool's slots upcast a span at a time (`PooledKeyTiles`). The
upcast is exact: the layout and the span size change no bit."""

from __future__ import annotations

import copy

import torch

from tonpolicy.kernels.attention_merge import KEY_PAD_POS

# fp32 key elements (per operand) one span of pooled keys is upcast into at a time, and the fewest tiles
# a span holds (the per-span ops' fixed cost): bench_engine's context sweep picks them.
SPAN_ELEMENTS = 1 << 19
SPAN_MIN_TILES = 8
# Keys per span from which a pooled K span is first copied as bf16, then upcast: spans this long come
# from contexts whose cache is out of cache (DRAM), where the plain copy of the d-major rows and then an
# upcast in cache beats one upcasting copy; in cache the one copy is faster. Same values either way
# (the upcast is exact).
STAGE_KEYS = 1024


class KeyTiles:
    """Key tiles in the GEMM layouts, fp32: k [B*Hkv, D, Kt*T], v [Kt, B*Hkv, T, D]; positions [B, Kt, T]."""

    # Tiles per span a block's partials are computed over (all: the keys are already in memory).
    chunk = 1 << 62

    def __init__(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, heads: int, source_dtype: torch.dtype
    ) -> None:
        self.k, self.v, self.pos, self.heads = k, v, pos, heads
        self.source_dtype = source_dtype  # what the keys were before the upcast
        self.tiles, self.tile = pos.shape[1], pos.shape[2]
        self.requires_grad = k.requires_grad or v.requires_grad

    def span(self, a: int, b: int, upcast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles [a, b) (contiguous: a GEMM reading a strided operand may take another path); already fp32,
        whatever `upcast` says."""
        if (a, b) == (0, self.tiles):
            return self.k, self.v
        t = self.tile
        k = self.k.view(*self.k.shape[:2], self.tiles, t)[..., a:b, :].reshape(*self.k.shape[:2], (b - a) * t)
        return k, self.v[a:b]


class PooledKeyTiles:
    """Key tiles [0, tiles) of pool slots `slots` in a head-layout KV pool (k [S, Hkv, D, cap],
    v [S, Hkv, cap, D]; key j at position j), upcast to the GEMM layouts of `KeyTiles` a span at a time:
    one upcasting copy with contiguous rows on both sides (no transpose; a gather only when the slots
    are not a run). A single query block
    (decode) reads spans of about SPAN_ELEMENTS, so each fp32 copy is used while in cache (the whole
    copy at once is slower: it streams through memory)."""

    requires_grad = False

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, tiles: int, tile: int):
        self.k_pool, self.v_pool, self.slots, self.slot_index = k_pool, v_pool, slots.tolist(), slots
        self.heads, self.tiles, self.tile = k_pool.shape[1], tiles, tile
        self.source_dtype = k_pool.dtype
        b, d = len(self.slots), k_pool.shape[2]
        self.pos = torch.arange(tiles * tile, device=k_pool.device).view(1, tiles, tile).expand(b, tiles, tile)
        self.chunk = max(SPAN_MIN_TILES, SPAN_ELEMENTS // (b * self.heads * d * tile))
        first = self.slots[0]
        self.run = self.slots == list(range(first, first + len(self.slots)))

    def with_slots(self, slots: torch.Tensor) -> PooledKeyTiles:
        """The same geometry over other pool slots (as many): positions and span sizes unchanged."""
        other = copy.copy(self)
        other.slots, other.slot_index = slots.tolist(), slots
        first = other.slots[0]
        other.run = other.slots == list(range(first, first + len(other.slots)))
        return other

    def over(self, k_pool: torch.Tensor | None, v_pool: torch.Tensor | None) -> PooledKeyTiles:
        """The same slots and tiles of another layer's pools (shapes equal): no geometry recomputed."""
        other = copy.copy(self)
        other.k_pool, other.v_pool = k_pool, v_pool
        return other

    def span(self, a: int, b: int, upcast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles [a, b) in the GEMM layouts, fp32, or with `upcast` False in the pool's dtype (for GEMMs that
        upcast their operands themselves: half the bytes copied and read for a bf16 pool, the same values)."""
        hkv, d, t, n = self.heads, self.k_pool.shape[2], self.tile, b - a
        dtype = torch.float32 if upcast else self.k_pool.dtype
        ks = torch.empty(len(self.slots), hkv, d, n * t, dtype=dtype, device=self.k_pool.device)
        vs = torch.empty(n, len(self.slots), hkv, t, d, dtype=dtype, device=self.v_pool.device)
        k, v = self.k_pool[..., a * t : b * t], self.v_pool[:, :, a * t : b * t]
        if self.run:  # a run of slots: a view, no gather
            first = self.slots[0]
            k, v = k[first : first + len(self.slots)], v[first : first + len(self.slots)]
        else:
            k, v = k.index_select(0, self.slot_index), v.index_select(0, self.slot_index)
        ks.copy_(k.contiguous() if upcast and n * t >= STAGE_KEYS else k)
        vs.copy_(v.view(-1, hkv, n, t, d).permute(2, 0, 1, 3, 4))
        return ks.view(-1, d, n * t), vs.view(n, -1, t, d)

    def whole(self) -> KeyTiles:
        """All tiles, upcast at once (for several query blocks, which would each read them)."""
        return KeyTiles(*self.span(0, self.tiles), self.pos, self.heads, self.source_dtype)


Keys = KeyTiles | PooledKeyTiles


def key_tiles(k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, tile: int) -> KeyTiles:
    """Token-major keys [B, Nk, Hkv, D] (positions [B, Nk]) as fp32 tiles, padded with zero k/v at
    KEY_PAD_POS."""
    b, nk, hkv, d = k.shape
    kt = max(1, -(-nk // tile))
    extra = kt * tile - nk
    if extra:
        k = torch.cat([k, k.new_zeros(b, extra, hkv, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, extra, hkv, d)], dim=1)
        k_pos = torch.cat([k_pos, k_pos.new_full((b, extra), KEY_PAD_POS)], dim=1)
    # One transposing upcast each (the upcast is exact).
    ks = torch.empty(b, hkv, d, kt * tile, device=k.device).copy_(k.permute(0, 2, 3, 1))
    vs = torch.empty(kt, b, hkv, tile, d, device=v.device).copy_(v.view(b, kt, tile, hkv, d).permute(1, 0, 3, 2, 4))
    return KeyTiles(
        ks.view(b * hkv, d, kt * tile), vs.view(kt, b * hkv, tile, d), k_pos.reshape(b, kt, tile), hkv, k.dtype
    )
