"""Contiguous KV cache pool for the rollout engine: one slot per running request.

Per layer, k and v hold [slots, capacity] positions of [Hkv, D] in the cache dtype, capacity a multiple
of the attention tile, in one of two layouts the kernel set picks (`kv_pool_layout`):
- "token": k and v [slots, capacity, Hkv, D];
- "head": k [slots, Hkv, D, capacity] and v [slots, Hkv, capacity, D]: per slot and KV head, the keys
  already in the layout the attention GEMMs read ([D, keys] and [keys, D]), so decode upcasts the visible
  prefix with contiguous rows instead of gathering and transposing.
Slots are reused without clearing: the causal mask gives stale keys exactly zero weight and stale
values are finite, so 0 * v adds exactly zero (same as the zero padding).
"""

from __future__ import annotations

import torch

LAYOUTS = ("token", "head")


def convert_layout(k: torch.Tensor, v: torch.Tensor, src: str, dst: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's pooled k/v in layout `src` as layout `dst` (copies; for a kernel set of another layout)."""
    if src == dst:
        return k, v
    if src == "head":  # k [S, H, D, cap], v [S, H, cap, D] -> [S, cap, H, D]
        return k.permute(0, 3, 1, 2).contiguous(), v.permute(0, 2, 1, 3).contiguous()
    return k.permute(0, 2, 3, 1).contiguous(), v.permute(0, 2, 1, 3).contiguous()


class KVPool:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        tile: int,
        device: torch.device | str = "cpu",
        layout: str = "token",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"KV pool layout must be one of {LAYOUTS}, got {layout!r}")
        self.capacity = -(-capacity // tile) * tile
        self.tile, self.layout = tile, layout
        if layout == "token":
            k_shape = v_shape = (slots, self.capacity, num_kv_heads, head_dim)
        else:
            k_shape = (slots, num_kv_heads, head_dim, self.capacity)
            v_shape = (slots, num_kv_heads, self.capacity, head_dim)
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(slots - 1, -1, -1))

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    def alloc(self) -> int:
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, Hkv, D] of positions [start, start + n) of `slot`."""
        n = k.shape[0]
        if start + n > self.capacity:
            raise ValueError(f"KV slot overflow: {start + n} > capacity {self.capacity}")
        if self.layout == "token":
            self.k[layer][slot, start : start + n] = k
            self.v[layer][slot, start : start + n] = v
            return
        self.k[layer][slot, :, :, start : start + n] = k.permute(1, 2, 0)
        self.v[layer][slot, :, start : start + n] = v.transpose(0, 1)

    def check_positions(self, last: int) -> None:
        if last >= self.capacity:
            raise ValueError(f"KV slot overflow: position {last} >= capacity {self.capacity}")

    def write_tokens(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        checked: bool = False,
    ) -> None:
        """Store k/v [n, Hkv, D] of token i at position positions[i] of slot slots[i] (one scatter for a
        whole decode batch). `checked`: the caller has `check_positions`-ed them (once for every layer)."""
        if not checked and positions.numel():
            self.check_positions(int(positions.max()))
        slots, positions = slots.to(k.device), positions.to(k.device)
        if self.layout == "token":
            self.k[layer][slots, positions] = k
            self.v[layer][slots, positions] = v
            return
        # Advanced indices apart, so the indexed dims come first: [n, Hkv, D] both.
        self.k[layer][slots, :, :, positions] = k
        self.v[layer][slots, :, positions, :] = v

    def copy_from(self, old: KVPool) -> None:
        """Take over every slot and position of a smaller pool of the same layout (pool growth)."""
        for dst, src in zip(self.k + self.v, old.k + old.v, strict=True):
            dst[tuple(slice(0, size) for size in src.shape)] = src
