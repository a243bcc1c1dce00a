"""The `ordered` kernel set (contract v2): exactness by owning the order of every sum.

Every GEMM output element is one fp32 FMA chain over its contraction in an order written in the source
(tonpolicy.kernels.ordered_gemm: ascending k, or bf16 pairs odd-then-even as the CPU's pair dot-product
instruction does, DAZ/FTZ on every FMA), vectorised across output columns only, threads splitting rows and
columns but never K. A row's bits therefore depend on that row and the weight alone: not on the batch,
the row's position, the tile, the thread count or the CPU (IEEE defines FMA exactly). The rest is the
`invariant` set's structure: canonical K-shards of the row-parallel linears summed in a fixed fp32 tree,
split-KV attention over fixed key tiles merged in key order (its scores and p @ v are ordered chains:
over the head dim, and over a tile's keys), and the same row-local ops.
"""

from __future__ import annotations

from typing import Any

import torch

from tonpolicy.kernels import ordered_gemm
from tonpolicy.kernels.invariant import InvariantKernels
from tonpolicy.kernels.invariant_attention import Products

# The attention's products as ordered fp32 chains (operands upcast exactly, whatever they came from).
ORDERED_PRODUCTS = Products(
    scores=lambda rows, q_dtype, k, k_dtype: ordered_gemm.bmm(rows, k),
    pv=lambda p, v, v_dtype: ordered_gemm.bmm(p, v),
)


class OrderedKernels(InvariantKernels):
    name = "ordered"
    products = ORDERED_PRODUCTS

    def __init__(self, **params: Any) -> None:
        ordered_gemm.require()  # a clear error before anything runs, not at the first GEMM
        super().__init__(**params)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        chains = ordered_gemm.describe()
        d.update(
            gemm=chains,
            linear="the ordered GEMM, K whole (column-parallel), rounded to the activation dtype",
            linear_k_sharded="the ordered GEMM per canonical K-shard [K/C] (each its own chain from +0), fp32 "
            "partials summed in fp32 in a pairwise tree, one rounding (o_proj, down)",
            logits="the ordered GEMM, K whole, fp32"
            if self.logits_dtype == "float32"
            else "the ordered GEMM rounded to bf16 (bf16 operands), then fp32",
            attention="split-KV fixed tile, fp32 (m,l,acc), left-to-right merge in key order; scores q.k as the "
            "fp32 chain over the head dim, p @ v as the fp32 chain over the tile's keys (operands upcast exactly)",
        )
        return d

    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        return ordered_gemm.linear_partials(x, weight, num_shards)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ordered_gemm.linear(x, weight).to(x.dtype)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = ordered_gemm.linear(x, weight)
        if self.logits_dtype == "float32" or not x.dtype == weight.dtype == torch.bfloat16:
            return logits
        return logits.to(torch.bfloat16).float()

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ordered_gemm.linear(x, weight)
