"""Contiguous KV cache pool for the rollout engine: one slot per running request.

Per layer, k and v are [slots, capacity, Hkv, D] in the model dtype, with capacity a multiple of the
attention tile. Slots are reused without clearing: the causal mask gives stale keys exactly zero
weight and stale values are finite, so 0 * v adds exactly zero (same as the zero padding).
"""

from __future__ import annotations

import torch


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
    ) -> None:
        self.capacity = -(-capacity // tile) * tile
        self.tile = tile
        shape = (slots, self.capacity, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(slots - 1, -1, -1))

    def alloc(self) -> int:
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        if start + n > self.capacity:
            raise ValueError(f"KV slot overflow: {start + n} > capacity {self.capacity}")
        self.k[layer][slot, start : start + n] = k
        self.v[layer][slot, start : start + n] = v
