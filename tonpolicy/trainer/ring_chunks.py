"""Ring CP's attention chunks: each chunk of the kernel set's split size (keys from position 0) is
computed whole, once all its keys have arrived round the ring, so the partials are the single-device
ones wherever the ring's blocks cut the sequence.

K/V blocks arrive in ring order, not key order, and a block boundary may fall inside a chunk (a zigzag
block holds seq_len / (2*cp) keys, a multiple of the tile, not of the chunk). A piece of a chunk waits
here until the rest of its keys come; the chunk's keys are then put in key order and handed over.
"""

from __future__ import annotations

import torch


class ChunkAssembler:
    def __init__(self, chunk: int, seq_len: int, last_query: int) -> None:
        """chunk: keys per chunk; seq_len: keys in the (padded) sequence; chunks starting after
        last_query are dropped (fully masked for every local query)."""
        self.chunk, self.seq_len, self.last_query = chunk, seq_len, last_query
        self._pieces: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def add(
        self, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Keys k/v [n, Hkv, D] at positions k_pos [n] (runs of consecutive positions) -> the chunks
        they complete, as (chunk index, k, v, positions) in key order."""
        done = []
        for lo, hi in self._runs(k_pos):
            c = int(k_pos[lo]) // self.chunk
            if c * self.chunk > self.last_query:
                continue
            pieces = self._pieces.setdefault(c, [])
            pieces.append((int(k_pos[lo]), k[lo:hi], v[lo:hi], k_pos[lo:hi]))
            if sum(p[1].shape[0] for p in pieces) == min(self.chunk, self.seq_len - c * self.chunk):
                pieces.sort(key=lambda p: p[0])
                del self._pieces[c]
                done.append((c, *(torch.cat([p[i] for p in pieces]) for i in (1, 2, 3))))
        return done

    def _runs(self, k_pos: torch.Tensor) -> list[tuple[int, int]]:
        """[lo, hi) index ranges of consecutive positions inside one chunk."""
        cut = ((k_pos[1:] // self.chunk) != (k_pos[:-1] // self.chunk)) | (k_pos[1:] != k_pos[:-1] + 1)
        bounds = [0, *(torch.nonzero(cut).flatten() + 1).tolist(), k_pos.shape[0]]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def check_complete(self) -> None:
        if self._pieces:
            raise RuntimeError(f"ring CP left chunks incomplete: {sorted(self._pieces)}")
