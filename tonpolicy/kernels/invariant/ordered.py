"""The `ordered` kernel set (contract v2): exactness by owning the order of every sum.

Every GEMM output element is one fp32 FMA chain over its contraction in an order written in the source
(tonpolicy.kernels.invariant.ordered_gemm: ascending k, or bf16 pairs odd-then-even as the CPU's pair dot-product
instruction does, DAZ/FTZ on every FMA), vectorised across output columns only, threads splitting rows and
columns but never K. A row's bits therefore depend on that row and the weight alone: not on the batch,
the row's position, the tile, the thread count or the CPU (IEEE defines FMA exactly). The rest is the
`invariant` set's structure: canonical K-shards of the row-parallel linears summed in a fixed fp32 tree,
split-KV attention over fixed key tiles merged in key order (its scores and p @ v are ordered chains:
over the head dim, and over a tile's keys), and the same row-local ops.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

from tonpolicy.kernels import moe
from tonpolicy.kernels.invariant import ordered_gemm, ordered_rowwise, ordered_rowwise_attention
from tonpolicy.kernels.invariant.attention import Products
from tonpolicy.kernels.invariant.kernel_set import InvariantKernels


class _Exp(torch.autograd.Function):
    """The owned exp, differentiable (d exp(x) = exp(x) dx)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        y = ordered_rowwise.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (y,) = ctx.saved_tensors
        return g * y


class _RowSum(torch.autograd.Function):
    """The owned last-dim sum, differentiable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.shape = x.shape
        return ordered_rowwise.row_sum(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g.unsqueeze(-1).expand(ctx.shape)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return _Exp.apply(x) if torch.is_grad_enabled() and x.requires_grad else ordered_rowwise.exp(x)


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    return _RowSum.apply(x) if torch.is_grad_enabled() and x.requires_grad else ordered_rowwise.row_sum(x)


# The attention's products as ordered fp32 chains (operands upcast exactly, whatever they came from), its
# exp and sums the project's own (tonpolicy.kernels.invariant.ordered_rowwise).
ORDERED_PRODUCTS = Products(
    scores=lambda rows, q_dtype, k, k_dtype: ordered_gemm.bmm(rows, k),
    pv=lambda p, v, v_dtype: ordered_gemm.bmm(p, v),
    exp=_exp,
    exp_=ordered_rowwise.exp_,
    row_sum=_row_sum,
    softmax_tiles=ordered_rowwise_attention.softmax_tiles,
    merge_finalize=ordered_rowwise_attention.merge_finalize,
    upcasts_operands=True,
)


@functools.cache
def library_digest() -> str:
    """sha256 of the C++ that computes every bit of the set (its GEMMs and its row-local ops)."""
    text = ordered_gemm.SOURCE_FILE.read_bytes() + b"\0" + ordered_rowwise.SOURCE_FILE.read_bytes()
    return hashlib.sha256(text).hexdigest()


class OrderedKernels(InvariantKernels):
    name = "ordered"
    products = ORDERED_PRODUCTS
    # Every GEMM, exp, log and sum is this set's own code, the rest IEEE-exact elementwise ops: no library,
    # CPU class or torch build decides a bit (the runtime fingerprint carries the code, not the host).
    bits_depend_on_host = False

    def __init__(self, **params: Any) -> None:
        ordered_gemm.require()  # a clear error before anything runs, not at the first GEMM
        ordered_rowwise.require()
        super().__init__(**params)

    def library_digest(self) -> str:
        return library_digest()

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
            "fp32 chain over the head dim, p @ v as the fp32 chain over the tile's keys (operands upcast exactly); "
            "exp and the tile's sum of p the row-local ops' own",
            rowwise=ordered_rowwise.describe(),
            rms_norm="the row-local ops' rms_norm",
            swiglu="the row-local ops' swiglu",
            rope="the row-local ops' rope tables (own exp/log/sin/cos), fp32 rotate-half",
            logprobs="the row-local ops' logprobs: fp32 (z_t - max z) - log(sum exp(z - max z)), z = logits[:vocab]/T",
        )
        return d

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ordered_rowwise.rms_norm(x, weight, eps)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ordered_rowwise.swiglu(gate, up)

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        return ordered_rowwise.rope_cos_sin(positions, head_dim, theta)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        return ordered_rowwise.logprobs(logits, tokens, vocab_size, temperature)

    def log_softmax(self, logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        """Every token's logprob, each column bitwise `logprobs` at that token (prompt and top-k logprobs)."""
        return ordered_rowwise.log_softmax(logits, vocab_size, temperature)

    def log_normalizer(self, logits: torch.Tensor, vocab_size: int, temperature: float):  # noqa: ANN201
        """(m, L) with logprob(t) = (z_t - m) - L: the recipe's normalizer, for consumers that subtract."""
        return ordered_rowwise.log_normalizer(logits, vocab_size, temperature)

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

    def route(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> moe.Routing:
        return moe.contract_route(logits, top_k, norm_topk_prob, exp=_exp)

    def describe_moe(self) -> dict[str, Any]:
        d = super().describe_moe()
        d["routing_weights"] = d["routing_weights"].replace("exp,", "the row-local ops' exp,")
        return d
