"""The trainer's logprob recipe.

gather the full (padded) vocab across TP -> truncate to the real vocab -> fp32 log_softmax(logits / T)
-> gather the target token. Every TP rank then holds the same full logits and computes the same
(replicated) loss, so the all-gather's backward must *narrow* the gradient to the local vocab shard:
`comm.replicated_all_gather`. Megatron's stock all-gather (`all_gather_last_dim_from_tensor_parallel_region`)
has a reduce-scatter backward, right when each rank owns a different loss, but here it sums TP identical
gradients and inflates every gradient (and grad_norm) by about TP.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region

from tonpolicy.kernels import get_kernels
from tonpolicy.trainer.comm import replicated_all_gather


def gather_vocab(local_logits: torch.Tensor, stock_gather: bool = False) -> torch.Tensor:
    """Full padded-vocab logits on every TP rank. `stock_gather` uses Megatron's reduce-scatter-backward
    gather (only to reproduce the grad-norm inflation)."""
    group = parallel_state.get_tensor_model_parallel_group()
    if stock_gather:
        return all_gather_last_dim_from_tensor_parallel_region(local_logits, group)
    return replicated_all_gather(local_logits, -1, group)


def token_logprobs(
    local_logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int,
    temperature: float,
    kernels: Any | None = None,
    stock_gather: bool = False,
) -> torch.Tensor:
    """fp32 logprob of `tokens` [...] from this TP rank's vocab shard of the logits [..., V_pad/TP].
    `kernels`: the kernel set whose `logprobs` is the recipe; None (Megatron's stock spec) -> the `plain`
    set's, on fp32 logits (the stock output layer may hand over bf16)."""
    full = gather_vocab(local_logits, stock_gather)
    if kernels is None:
        return get_kernels("plain").logprobs(full.float(), tokens, vocab_size, temperature)
    return kernels.logprobs(full, tokens, vocab_size, temperature)
