"""Zigzag ring context-parallel attention: exact contract forward, flash-style ring backward.

Forward: K/V blocks travel round the CP ring; every key chunk (the set's split size: its
`attention_chunk`, else its tile) is computed whole once its keys have reached this rank
(`ring_chunks`), its partial of the local queries by the kernel set; at the end the partials are merged
in ascending key order with `kernels.merge` and finalized, exactly the single-device fold (chunks
entirely after every local query are skipped: the contract makes a fully masked merge an exact no-op).

Backward (not under the contract): the textbook softmax-attention gradient from the saved output and
log-sum-exp, block by block as K/V travel the ring again, their gradients travelling with them and
arriving home after CP hops: dS = P * (dP - rowsum(dO * O)), dQ += dS K, dK += dS^T Q, dV += P^T dO.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state

from tonpolicy.trainer import cp_layout
from tonpolicy.trainer.comm import shift
from tonpolicy.trainer.ring_chunks import ChunkAssembler


def _block_positions(seq_len: int, cp: int, src: int, device: torch.device) -> torch.Tensor:
    return cp_layout.local_positions(seq_len, cp, src, "ring").to(device)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, kernels: Any
    ) -> torch.Tensor:
        cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        group = parallel_state.get_context_parallel_group()
        tile = kernels.attention_tile
        seq_len = positions.shape[0] * cp
        if seq_len % (2 * cp * tile):
            raise ValueError(f"ring CP needs the sequence ({seq_len}) padded to a multiple of 2*CP*tile")
        # The unit whose partials merge by the merge formula: a set's chunk (the triton set's split size),
        # else its tile. Chunks are computed whole wherever the ring's blocks cut them.
        chunk = getattr(kernels, "attention_chunk", tile)
        partial_of = kernels.attention_chunk_partial if chunk != tile else kernels.attention_tile_partial
        chunks = ChunkAssembler(chunk, seq_len, int(positions.max()))
        partials: dict[int, Any] = {}
        kv = torch.cat([k, v], dim=1)
        for step in range(cp):
            k_pos = _block_positions(seq_len, cp, (rank - step) % cp, q.device)
            kb, vb = kv.split([k.shape[1], v.shape[1]], dim=1)
            for c, kc, vc, pc in chunks.add(kb, vb, k_pos):
                partials[c] = partial_of(q, kc, vc, positions, pc, scale)
            if step + 1 < cp:
                kv = shift(kv, group, 1)
        chunks.check_complete()
        order = sorted(partials)
        if order != list(range(len(order))):
            raise RuntimeError(f"ring CP missed key chunks: {order}")
        acc = partials[order[0]]
        for t in order[1:]:
            acc = kernels.merge(acc, partials[t])
        out = kernels.finalize(acc, q.dtype)
        lse = acc.m + torch.log(acc.l)  # [Nq, Hq]; every query sees key 0, so l > 0
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.scale, ctx.meta = scale, (cp, rank, seq_len, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, positions, out, lse = ctx.saved_tensors
        cp, rank, seq_len, group = ctx.meta
        hkv, g, d = k.shape[1], q.shape[1] // k.shape[1], q.shape[2]
        qf, do = q.float(), grad.float()
        delta = (do * out.float()).sum(-1)  # [Nq, Hq]
        dq = torch.zeros_like(qf)
        kv = torch.cat([k, v], dim=1).float()
        dkv = torch.zeros_like(kv)
        for step in range(cp):
            k_pos = _block_positions(seq_len, cp, (rank - step) % cp, q.device)
            kb, vb = (t.repeat_interleave(g, dim=1) for t in kv.split([hkv, hkv], dim=1))  # [Nk, Hq, D]
            visible = (k_pos[None, :] <= positions[:, None]).unsqueeze(0)  # [1, Nq, Nk]
            s = torch.einsum("qhd,khd->hqk", qf, kb) * ctx.scale
            p = torch.where(visible, torch.exp(s - lse.t().unsqueeze(-1)), torch.zeros_like(s))
            dp = torch.einsum("qhd,khd->hqk", do, vb)
            ds = p * (dp - delta.t().unsqueeze(-1)) * ctx.scale
            dq += torch.einsum("hqk,khd->qhd", ds, kb)
            dk = torch.einsum("hqk,qhd->khd", ds, qf).reshape(-1, hkv, g, d).sum(2)
            dv = torch.einsum("hqk,qhd->khd", p, do).reshape(-1, hkv, g, d).sum(2)
            dkv += torch.cat([dk, dv], dim=1)
            # Gradients travel with their block; after CP hops each block's gradient is back home.
            dkv = shift(dkv, group, 1)
            if step + 1 < cp:
                kv = shift(kv, group, 1)
        dk, dv = dkv.split([hkv, hkv], dim=1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
