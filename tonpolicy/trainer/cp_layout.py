"""Context-parallel token layout, the microbatch's positions as Megatron carries them, and the one
response slicer.

Ulysses shards the sequence into CP contiguous chunks (attention all-to-alls heads, so each head's
sequence is whole again); ring uses zigzag: 2*CP chunks, rank r holds chunks r and 2*CP-1-r, every
chunk a multiple of the attention tile so remote key tiles line up with the single-device kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class TokenPositions(PackedSeqParams):
    """Absolute positions [b, s_local] of this rank's tokens in the microbatch, passed to the model as
    `packed_seq_params`: Megatron hands that argument, untouched, down to every layer's core attention
    (it reads only `qkv_format == "thd"`, which this is not). The contract attention needs them: RoPE
    and the causal mask use absolute positions under CP, and a packed row restarts at 0 per sample."""

    positions: torch.Tensor | None = None
    qkv_format: str = "sbhd"


def segment_starts(positions: torch.Tensor) -> list[int]:
    """Where the samples of a packed row start (position 0 again); [0] for an ordinary row, and for a
    CP rank's chunks (packing is refused under CP)."""
    starts = (positions == 0).nonzero().flatten().tolist()
    return starts if starts and starts[0] == 0 else [0]


def padded_len(n: int, cp: int, cp_type: str, tile: int) -> int:
    mult = 2 * cp * tile if (cp > 1 and cp_type == "ring") else cp
    return -(-n // mult) * mult


def local_positions(seq_len: int, cp: int, rank: int, cp_type: str) -> torch.Tensor:
    """Absolute positions this CP rank holds, in local order (seq_len already padded)."""
    if cp == 1:
        return torch.arange(seq_len)
    if cp_type == "ulysses":
        c = seq_len // cp
        return torch.arange(rank * c, (rank + 1) * c)
    if cp_type == "ring":
        c = seq_len // (2 * cp)
        first, second = rank, 2 * cp - 1 - rank
        return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])
    raise ValueError(f"unknown CP type {cp_type!r}")


@dataclass(frozen=True)
class ResponseSlice:
    """Local rows whose logits predict a response token, and that token's index in the response."""

    rows: torch.Tensor
    resp: torch.Tensor


def response_slice(positions: torch.Tensor, prompt_len: int, response_len: int) -> ResponseSlice:
    """The row at absolute position p predicts token p+1; response token j sits at prompt_len + j."""
    nxt = positions + 1 - prompt_len
    keep = (nxt >= 0) & (nxt < response_len)
    return ResponseSlice(rows=keep.nonzero().flatten(), resp=nxt[keep])


def shift(s: ResponseSlice, offset: int) -> ResponseSlice:
    """The same response rows, `offset` rows later (a sample packed after others in its row)."""
    return ResponseSlice(rows=s.rows + offset, resp=s.resp)


def slice_responses(
    per_row: list[torch.Tensor], per_response: list[dict[str, torch.Tensor]], slices: list[ResponseSlice]
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The one slicer for every CP type: for each sample, (this rank's rows of a per-row tensor such as
    the logits, the matching entries of each per-response-token tensor: targets, loss mask, old
    logprobs, advantages)."""
    return [
        (x[s.rows.to(x.device)], {k: v[s.resp] for k, v in y.items()})
        for x, y, s in zip(per_row, per_response, slices, strict=True)
    ]
