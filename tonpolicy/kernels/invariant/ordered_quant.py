"""The `ordered` set with its contract.quant choice: "none" is the v2 set as it is; "fp8_block" computes the
attention and MLP linears (and the MoE experts) as block-scaled e4m3 GEMMs (ordered_fp8) on operands
quantized by the contract's one rule (tonpolicy.kernels.fp8_block), from whatever master weight the caller
holds. The LM head, norms, router and attention's q.k and p.v stay v2's.

The engine and the trainer call the same `linear` / `linear_partials`, so the trainer's forward is the
rollout's fake-quantized computation; its backward (the trainer's KernelLinear, the STE wrapper here) is the
plain linear's gradient on the master weight and the unquantized input: straight-through."""

from __future__ import annotations

from typing import Any

import torch

from tonpolicy.kernels.fp8_block import BLOCK
from tonpolicy.kernels.invariant import ordered_fp8
from tonpolicy.kernels.invariant.exact_gemm import _TextbookGrad
from tonpolicy.kernels.invariant.ordered import OrderedKernels

FP8_DESCRIPTION = {
    "weights": f"per HF weight [N, K] (fused q/k/v and gate/up quantized per HF weight), blocks of {BLOCK} x "
    f"{BLOCK}, the last of a dimension partial: amax |w| fp32 over the whole block (a block split across TP "
    "ranks: the max of the ranks' amaxes); scale_inv = amax/448 (fp32, RNE), below 2^-126 -> 1.0; "
    "q = e4m3 RNE of clamp(w/scale_inv, -448, 448)",
    "activations": f"per token, groups of {BLOCK} along K: the weights' rule",
    "gemm": f"per K-group of {BLOCK}: S = the bf16 pair chain of the e4m3 values (exact products) from +0; "
    "y = +0, y = y + S * (sa * sw) over groups ascending, each op one IEEE fp32 rounding, no FMA",
    "row_parallel": f"each canonical K-shard holds whole {BLOCK}-groups: its own group chain from +0, partials as v2",
    "quantized": "attention q/k/v/o and MLP gate/up/down linears, MoE experts; not the LM head, norms, router, "
    "attention's q.k and p.v",
}


def _ste(x: torch.Tensor, w: torch.Tensor, fn: Any) -> torch.Tensor:
    """fn(x, w), differentiable straight through the quantizers when autograd tracks it."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _TextbookGrad.apply(x, w.t(), lambda a, _b: fn(a.detach(), w.detach()))
    return fn(x, w)


class QuantOrderedKernels(OrderedKernels):
    def __init__(self, *, quant: str = "none", **params: Any) -> None:
        super().__init__(**params)
        self.quant = quant
        self.fp8 = quant == "fp8_block"
        # Column shards keep their bits at whole weight blocks (the host check splits there).
        self.column_block = BLOCK if self.fp8 else 1

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["quant"] = self.quant
        if self.fp8:
            d["fp8_block"] = FP8_DESCRIPTION
            d["linear"] = "the fp8_block GEMM, K whole (column-parallel), rounded to the activation dtype"
            d["linear_k_sharded"] = (
                "the fp8_block GEMM per canonical K-shard (each its own group chain from +0), fp32 partials "
                "summed in fp32 in a pairwise tree, one rounding (o_proj, down)"
            )
        return d

    def describe_moe(self) -> dict[str, Any]:
        d = super().describe_moe()
        if self.fp8:
            d["experts_quant"] = "fp8_block: the experts' gate/up and down as the dense linears"
        return d

    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        if not self.fp8:
            return super().linear_partials(x, weight, num_shards)
        return _ste(x, weight, lambda a, w: ordered_fp8.fp8_linear_partials(a, w, num_shards))

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: ordered_fp8.RowParts | None = None,
        reduce_amax: ordered_fp8.AmaxReduce | None = None,
    ) -> torch.Tensor:
        """`rows`: the HF weights weight's rows come from (a fused or TP-sharded weight), `reduce_amax`: the
        max over the ranks holding the other parts of its blocks (ordered_fp8). Without fp8 they change
        nothing: a fused linear's columns are the separate ones'."""
        if not self.fp8:
            return super().linear(x, weight)
        return _ste(x, weight, lambda a, w: ordered_fp8.fp8_linear(a, w, rows, reduce_amax)).to(x.dtype)
