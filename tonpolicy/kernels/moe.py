"""Mixture-of-experts ops: routing (top-k of the router logits, routing weights) and the combine of
the k expert outputs, in the contract's form (`invariant`, `triton`) and the plain one (the control).

The contract's rule: a token's expert set, weights and output depend on nothing but its own router
logits and its own expert outputs.
- router logits in fp32 from the set's row-invariant GEMM (bf16 logits tie at the k-th place on a
  few percent of token-layers);
- top-k by a stable rule: descending logit, the lower expert id first on a tie (`torch.topk` on CPU
  picks either on a tie);
- routing weights: with `norm_topk_prob`, the softmax over the k selected logits, else the softmax over
  all logits gathered at the k; fp32, reductions as explicit column adds in a fixed order (no library
  reduction whose order could depend on the ISA or the row count);
- the k outputs taken in ascending expert id, w * y accumulated in fp32 and rounded once.
Every op is row-local, so expert parallelism (which only moves rows between ranks) cannot change a bit.
Differentiable torch ops throughout, so the trainer's backward runs through them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

DESCRIPTION = {
    "router_logits": "the set's row-invariant GEMM, K whole, fp32 (never rounded to the activation dtype)",
    "topk": "stable: descending logit, lower expert id first on a tie (a stable sort)",
    "routing_weights": "fp32; norm_topk_prob: softmax over the k selected logits, else softmax over all "
    "gathered at the k; max by comparisons, exp, sums as left-to-right column adds",
    "expert_mlp": "per expert: gate/up by the contract linear (K whole), swiglu, down over canonical K-shards "
    "summed in fp32 and left in fp32",
    "combine": "the k outputs in ascending expert id, sum of w*y left to right in fp32, one rounding",
    "capacity": "dropless",
}


class Routing(NamedTuple):
    """A token's routes: `experts` [N, k] in ascending expert id, `weights` fp32 [N, k] in the same
    order, `logits` the fp32 router logits [N, E] (for the aux loss and for records)."""

    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as left-to-right column adds (the order owned here, not by a library)."""
    acc = x[..., 0]
    for j in range(1, x.shape[-1]):
        acc = acc + x[..., j]
    return acc


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).values  # a max is exact in any order


def _softmax(x: torch.Tensor, exp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    e = exp(x - _row_max(x).unsqueeze(-1))
    return e / _row_sum(e).unsqueeze(-1)


def contract_route(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp,
) -> Routing:
    """`exp` is the kernel set's (a set that owns its exp passes it: then no library decides a bit)."""
    logits = logits.float()
    ranked = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    experts = ranked.sort(dim=-1).values  # ascending expert id: the combine's order
    chosen = logits.gather(-1, experts)
    weights = _softmax(chosen, exp) if norm_topk_prob else _softmax(logits, exp).gather(-1, experts)
    return Routing(experts, weights, logits)


def contract_combine(outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """outputs [N, k, H] (fp32 expert outputs, slots in ascending expert id), weights fp32 [N, k]."""
    y, w = outputs.float(), weights.float()
    acc = y[:, 0] * w[:, 0, None]
    for j in range(1, y.shape[1]):
        acc = acc + y[:, j] * w[:, j, None]
    return acc.to(out_dtype)


def plain_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """transformers' Qwen3-MoE router: softmax over all experts, `torch.topk`, renormalised by a sum."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    order = idx.argsort(dim=-1)
    return Routing(idx.gather(-1, order), top.gather(-1, order), logits.float())


def plain_combine(outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """As transformers: each output scaled by its weight in the activation dtype, summed in that dtype."""
    return (outputs.to(out_dtype) * weights.to(out_dtype).unsqueeze(-1)).sum(dim=1)
