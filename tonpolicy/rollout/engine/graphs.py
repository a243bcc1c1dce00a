"""Decode steps replayed from CUDA graphs, one per batch-size bucket (as SGLang's decode graphs).

A decode-only engine step is padded up to the smallest bucket (1, 2, 4, 8, ... up to the engine's
max running requests) and run through `Qwen3.forward_decode` on static buffers: token ids, positions
and KV slots are device tensors copied in before the replay, so nothing baked into a graph changes
from step to step (attention reads each row's position from memory and stops at its last tile).
Padding rows repeat row 0 (same token, position and slot): they write the same keys/values at the
same place, bit for bit, so the KV pool is as eager decode leaves it.

What the graph holds: embedding, every layer (KV write, attention over the pool), final norm and the
fp32 logits. What stays outside: sampling (per-request seeded CPU generators take the logits to the
host) and the logprob of the sampled token (it needs that token), as in eager decode.

Bits: under a row-invariant kernel set (the contract's row tiles) a row's logits do not depend on the
bucket it is padded into, and a replay runs the same kernels on the same addresses as the eager run it
was captured from. With `capture=False` the same padded static-buffer path runs eagerly (CPU tests, the
GPU check's comparison). Graphs are dropped and recaptured when the KV pool is replaced (growth) or the
weights change (a weight update rebuilds the fused weights the graph reads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tonpolicy.model.kv_cache import KVPool
from tonpolicy.model.qwen3 import Qwen3


def buckets(max_rows: int) -> list[int]:
    """Powers of two below max_rows, then max_rows itself."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return [*out, max_rows]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor | None  # the captured output (None until captured / run)


class DecodeGraphs:
    """Padded, static-buffer decode for one model; CUDA graphs when `capture` (a CUDA device)."""

    def __init__(self, model: Qwen3, max_rows: int, *, capture: bool, warmup: int = 2) -> None:
        if capture and model.model.embed_tokens.weight.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.capture, self.warmup = model, capture, warmup
        self.buckets = buckets(max_rows)
        dev = model.model.embed_tokens.weight.device
        cfg = model.cfg
        # The contract's rotary rows for every position, built once: a row is the same bits whichever
        # positions are asked together (tables are per position), and a device gather is capturable.
        self._cos, self._sin = model.kernels.rope_cos_sin(
            torch.arange(cfg.max_position_embeddings, device=dev), cfg.head_dim, cfg.rope_theta
        )
        self._graphs: dict[int, _Graph] = {}
        self._key: tuple | None = None  # (pool identity, weight versions) the graphs were captured for
        self._pool_ref: KVPool | None = None
        self._mem_pool = None
        self.capture_s: dict[int, float] = {}  # bucket -> seconds its capture took (warm-up included)
        self.replays: dict[int, int] = {}  # bucket -> decode steps run in it

    def bucket(self, rows: int) -> int | None:
        for b in self.buckets:
            if b >= rows:
                return b
        return None

    def _weights_key(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def _step(self, g: _Graph, pool: KVPool) -> torch.Tensor:
        cos, sin = self._cos.index_select(0, g.positions), self._sin.index_select(0, g.positions)
        return self.model.forward_decode(g.ids, g.positions, g.slots, pool, cos, sin)

    def _buffers(self, size: int) -> _Graph:
        dev = self._cos.device
        z = torch.zeros(size, dtype=torch.long, device=dev)
        return _Graph(None, z, z.clone(), z.clone(), None)

    def _capture(self, size: int, pool: KVPool) -> _Graph:
        """Warm up (Triton compiles, caches fill) on a side stream, then capture. The buffers hold the
        current step's rows, so warm-up and capture write exactly what this step writes."""
        g = self._graphs[size]
        t0 = time.perf_counter()
        self._step(g, pool)  # on this stream first: weight caches (fused, lm_head) live on the stream that uses them
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._step(g, pool)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._mem_pool is None:
            self._mem_pool = torch.cuda.graph_pool_handle()  # buckets share one memory pool
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's HTTP thread may touch CUDA while the engine thread captures.
        with torch.cuda.graph(graph, pool=self._mem_pool, capture_error_mode="thread_local"):
            g.logits = self._step(g, pool)
        g.graph = graph
        torch.cuda.synchronize()
        self.capture_s[size] = time.perf_counter() - t0
        return g

    @torch.no_grad()
    def run(self, ids: list[int], positions: list[int], slots: list[int], pool: KVPool) -> torch.Tensor:
        """fp32 logits [len(ids), padded_vocab] of one decode token per row (a view of static memory:
        valid until the next call)."""
        n = len(ids)
        size = self.bucket(n)
        if size is None or n == 0:
            raise ValueError(f"{n} decode rows do not fit the buckets {self.buckets}")
        pool.check_positions(max(positions))
        key = (id(pool), pool.capacity, pool.slots, self._weights_key())
        if key != self._key:  # a new pool or new weights: the captured addresses are stale
            self._graphs, self._key, self._pool_ref = {}, key, pool
            self._mem_pool = None  # and a fresh memory pool for the new captures
        pad = size - n
        host = torch.tensor([ids + ids[:1] * pad, positions + positions[:1] * pad, slots + slots[:1] * pad])
        g = self._graphs.get(size)
        fresh = g is None
        if fresh:
            g = self._graphs[size] = self._buffers(size)
        g.ids.copy_(host[0], non_blocking=True)
        g.positions.copy_(host[1], non_blocking=True)
        g.slots.copy_(host[2], non_blocking=True)
        if not self.capture:
            g.logits = self._step(g, pool)
        elif fresh:
            self._capture(size, pool)  # warm-up runs write this step's keys/values (the same bits)
            assert g.graph is not None
            g.graph.replay()  # capture records without running: the step's logits come from a replay
        else:
            assert g.graph is not None
            g.graph.replay()
        self.replays[size] = self.replays.get(size, 0) + 1
        assert g.logits is not None
        return g.logits[:n]
