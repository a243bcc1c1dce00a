"""The trainer's logprob recipe.

gather the full (padded) vocab across TP -> truncate to the real vocab -> fp32 log_softmax(logits / T)
-> gather the target token. Every TP rank then holds the same full logits and computes the same
(replicated) loss, so the all-gather's backward must *narrow* the gradient to the local vocab shard.
Megatron's stock all-gather (`all_gather_last_dim_from_tensor_parallel_region`) has a reduce-scatter
backward, right when each rank owns a different loss, but here it sums TP identical gradients and
inflates every gradient (and grad_norm) by about TP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_gather_last_dim_from_tensor_parallel_region


class _ReplicatedLossAllGatherLastDim(torch.autograd.Function):
    """All-gather along the last dim (rank order); backward narrows to this rank's shard."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        if world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def gather_vocab(local_logits: torch.Tensor, stock_gather: bool = False) -> torch.Tensor:
    """Full padded-vocab logits on every TP rank. `stock_gather` uses Megatron's reduce-scatter-backward
    gather (only to reproduce the grad-norm inflation)."""
    group = parallel_state.get_tensor_model_parallel_group()
    if stock_gather:
        return all_gather_last_dim_from_tensor_parallel_region(local_logits, group)
    return _ReplicatedLossAllGatherLastDim.apply(local_logits, group)


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """Plain torch recipe (the `default` semantics): fp32 log_softmax over the real vocab."""
    lp = torch.log_softmax(logits[..., :vocab_size].float() / temperature, dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    local_logits: torch.Tensor,
    tokens: torch.Tensor,
    vocab_size: int,
    temperature: float,
    kernels: Any | None = None,
    stock_gather: bool = False,
) -> torch.Tensor:
    """fp32 logprob of `tokens` [...] from this TP rank's vocab shard of the logits [..., V_pad/TP].
    `kernels`: a tonpolicy kernel set whose `logprobs` defines the contract semantics; None -> plain torch."""
    full = gather_vocab(local_logits, stock_gather)
    if kernels is None:
        return reference_logprobs(full, tokens, vocab_size, temperature)
    return kernels.logprobs(full, tokens, vocab_size, temperature)
