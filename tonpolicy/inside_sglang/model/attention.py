"""Contract attention over SGLang's own KV pool.

SGLang owns the cache: `token_to_kv_pool` stores keys/values per token slot, `req_to_token_pool` maps
(request, position) to a slot. For each forward batch this module writes the new keys/values into
their slots (`set_kv_buffer` at `out_cache_loc`), gathers every request's keys [0, seq_len) in
position order, and runs the kernel set's split-KV attention with explicit positions. A key is
visible to a query iff its position is <= the query's; padding keys sit at a position above any
query and padding queries below any key, so they change no bits (see kernels/invariant/attention.py).
Whether a prefix came from the radix cache, a previous chunk or this very batch, a query reduces
over the same key tiles in the same order: the bits match a fresh full forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

from tonpolicy.kernels.attention_merge import KEY_PAD_POS, QUERY_PAD_POS
from tonpolicy.kernels.sets import kernel_set


@dataclass
class _LayerRef:
    """What `set_kv_buffer` reads off a layer."""

    layer_id: int


def _query_plan(q_lens: torch.Tensor, seq_lens: torch.Tensor, max_q: int) -> tuple[torch.Tensor, ...]:
    """Each request's new tokens as [B, Q] rows of the flat token batch: which are real (`query_valid`),
    their row in the batch (`query_rows`; padding repeats the request's first) and their positions
    (`query_pos`; padding below any key)."""
    j = torch.arange(max_q, device=q_lens.device)
    valid = j[None, :] < q_lens[:, None]
    starts = torch.cumsum(q_lens, 0) - q_lens  # each request's first row in the flat token batch
    rows = starts[:, None] + j[None, :]
    prefix = (seq_lens - q_lens)[:, None]
    positions = torch.where(valid, prefix + j[None, :], torch.full_like(rows, QUERY_PAD_POS))
    return valid, torch.where(valid, rows, starts[:, None].expand(-1, max_q)), positions


class PooledAttention:
    """Per-batch gather plan: built once per forward, used by every layer."""

    def __init__(self, forward_batch, kernels, scale: float) -> None:  # noqa: ANN001 - SGLang's ForwardBatch
        self.kernels, self.scale = kernels, scale
        self.pool = get_token_to_kv_pool()
        fb = forward_batch
        dev = fb.seq_lens.device
        seq_lens = fb.seq_lens.long()
        if fb.forward_mode.is_decode():
            q_lens = torch.ones_like(seq_lens)
        else:
            q_lens = fb.extend_seq_lens.long()
        bsz = seq_lens.numel()
        max_keys, max_q = int(seq_lens.max()), int(q_lens.max())
        keys = torch.arange(max_keys, device=dev)
        self.key_valid = keys[None, :] < seq_lens[:, None]  # [B, L]
        slots = get_req_to_token_pool().req_to_token[fb.req_pool_indices.long(), :max_keys].long()
        self.slots = torch.where(self.key_valid, slots, torch.zeros_like(slots))
        self.key_pos = torch.where(self.key_valid, keys[None, :].expand(bsz, -1), torch.full_like(slots, KEY_PAD_POS))
        self.query_valid, self.query_rows, self.query_pos = _query_plan(q_lens, seq_lens, max_q)
        self.write_loc = KVWriteLoc.for_batch(fb)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] of this batch's new tokens -> attention output [N, Hq, D]."""
        self.pool.set_kv_buffer(_LayerRef(layer_id), self.write_loc, k, v)
        mask = self.key_valid[:, :, None, None]
        # Slots past a request's length are read as zeros: masked keys must hold finite values.
        keys = torch.where(mask, self.pool.get_key_buffer(layer_id)[self.slots], 0)
        values = torch.where(mask, self.pool.get_value_buffer(layer_id)[self.slots], 0)
        out = self.kernels.attention_batched(
            q[self.query_rows], keys.to(q.dtype), values.to(q.dtype), self.query_pos, self.key_pos, self.scale
        )
        return out[self.query_valid]


class TritonPoolAttention:
    """The `triton` set's attention read straight out of SGLang's pool: the kernel takes a token-slot
    table per request (`req_to_token` rows), so no key is copied. A decode batch needs no host value at
    all (the table's full width, lengths and positions stay on the device), which is what lets SGLang
    capture decode in CUDA graphs; a padded graph slot computes garbage that SGLang discards. The bits
    are those of `PooledAttention` and of a fresh full forward: key j sits at position j, keys past a
    request's length are never read, and a query's tiles are the same 64-key tiles from position 0."""

    def __init__(self, forward_batch, scale: float) -> None:  # noqa: ANN001 - SGLang's ForwardBatch
        from tonpolicy.kernels.triton import attention as triton_attention

        self.attention_indexed, self.scale = triton_attention.attention_indexed, scale
        self.pool = get_token_to_kv_pool()
        fb = forward_batch
        seq_lens = fb.seq_lens.long()
        dev, bsz = seq_lens.device, seq_lens.numel()
        table = get_req_to_token_pool().req_to_token
        self.decode = fb.forward_mode.is_decode()
        if self.decode:
            width = table.shape[1]  # fixed: the same shapes at capture and at every replay
            self.query_pos = (seq_lens - 1)[:, None]
        else:  # extend (never captured): host lengths are at hand
            lens = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else seq_lens.cpu()
            width = int(lens.max())
            q_lens = fb.extend_seq_lens.long()
            max_q = max(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu is not None else int(q_lens.max())
            self.query_valid, self.query_rows, self.query_pos = _query_plan(q_lens, seq_lens, max_q)
        # Built once per forward in the kernel's own types, so no layer converts or copies them again.
        self.slots = table[fb.req_pool_indices.long(), :width].long().contiguous()
        self.key_pos = torch.arange(width, device=dev).expand(bsz, -1).contiguous()
        self.num_keys = fb.seq_lens.to(torch.int32).contiguous()
        self.query_pos = self.query_pos.contiguous()
        self.write_loc = KVWriteLoc.for_batch(fb)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] of this batch's new tokens -> attention output [N, Hq, D]."""
        self.pool.set_kv_buffer(_LayerRef(layer_id), self.write_loc, k, v)
        keys, values = self.pool.get_key_buffer(layer_id), self.pool.get_value_buffer(layer_id)
        queries = q[:, None] if self.decode else q[self.query_rows]
        out = self.attention_indexed(
            queries, self.query_pos, keys, values, self.slots, self.key_pos, self.num_keys, self.scale
        )
        return out[:, 0] if self.decode else out[self.query_valid]


def pooled_attention(forward_batch, kernels, scale: float):  # noqa: ANN001, ANN201
    """The attention plan of one forward: a set whose kernel reads the pool (the triton set) gets it in
    place, the others gather keys for their split-KV attention."""
    if kernel_set(kernels.name).reads_kv_pool:
        return TritonPoolAttention(forward_batch, scale)
    return PooledAttention(forward_batch, kernels, scale)
