"""The `triton` kernel set: the contract's invariances at tensor-core speed on GPUs.

A kernel set of its own (its own fingerprint), not a CUDA build of `invariant`: bf16 operands multiply
on tensor cores (fp32 accumulation) instead of being upcast, K-shards fold left to right, exp/log are
Triton's. Its bits therefore differ from `invariant`'s on the CPU; what it guarantees is the same list
of invariances (batch, row, chunking, prefill/decode, TP 1/2/4, CP), between every caller of these
kernels on the same GPU model and Triton version (both are in the runtime fingerprint). Both engines
call it: the embedded engine and the SGLang model package through `KernelSet`, the Megatron layer
spec through the same functions.

Only the forward is under the contract. With autograd on, each row-local op runs the kernel forward
and the gradient of its textbook fp32 formula (`pointwise`), like the linears of
`trainer.kernel_autograd`; attention's backward is FlashAttention's (`attention_backward`). Runs on
CPU only under TRITON_INTERPRET=1 (tests; slow).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from tonpolicy.kernels import moe
from tonpolicy.kernels import pointwise as ref
from tonpolicy.kernels.base import AttnPartial
from tonpolicy.kernels.fp8_block import BLOCK
from tonpolicy.kernels.invariant.ordered_fp8 import AmaxReduce, RowParts
from tonpolicy.kernels.invariant.ordered_quant import FP8_DESCRIPTION, _ste
from tonpolicy.kernels.triton import attention as ta
from tonpolicy.kernels.triton import attention_backward as tab
from tonpolicy.kernels.triton import fp8_linear as tfp8
from tonpolicy.kernels.triton import linear as tlin
from tonpolicy.kernels.triton import rowwise as trow
from tonpolicy.kernels.triton import rowwise_backward as trow_bwd


class _KernelForward(torch.autograd.Function):
    """Forward by the kernel, backward by differentiating the reference formula (recomputed)."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable, reference: Callable, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        inputs = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, ctx.needs_input_grad[2:], strict=True)]
            out = ctx.reference(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, None, *[next(grads) if t.requires_grad else None for t in leaves])


def _run(kernel: Callable, reference: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _KernelForward.apply(kernel, reference, *inputs)
    return kernel(*inputs)


# The operands are fp8_block's (the ordered set's rule); the GEMM is this set's own.
_FP8_DESCRIPTION = {
    **{k: FP8_DESCRIPTION[k] for k in ("weights", "activations", "quantized")},
    "gemm": f"per canonical K-shard, per K-group of {BLOCK}: S = one tl.dot of the e4m3 operands from +0 (fp32 "
    f"accumulation; on sm_90 the MMA's own accumulator over the group, max_num_imprecise_acc={BLOCK}); y = +0, "
    "y = y + S * (sa * sw) over groups ascending, each op one fp32 rounding, no FMA; K-shard partials folded "
    "left to right; the result rounded to the activation dtype",
}


class TritonKernels:
    name = "triton"
    bits_depend_on_host = True  # library kernels (torch's, or Triton's for the GPU it runs on)

    def __init__(self, *, canonical_shards: int = 4, quant: str = "none") -> None:
        self.attention_tile = ta.TILE
        # The split size at which attention partials merge by the merge formula (ring CP's unit).
        self.attention_chunk = ta.CHUNK
        self.canonical_shards = canonical_shards
        self.quant = quant
        self.fp8 = quant == "fp8_block"  # the attention and MLP linears as block-scaled e4m3 GEMMs (fp8_linear)
        self.column_block = BLOCK if self.fp8 else 1

    def describe(self) -> dict[str, Any]:
        """Everything that affects numerics, for the contract fingerprint."""
        return {
            "kernel_set": self.name,
            "triton": triton.__version__,
            "canonical_shards": self.canonical_shards,
            "linear": f"tl.dot chain per output element, K walked from its start in {tlin.BLOCK_K}-wide steps, "
            "fp32 accumulation; K whole for column-parallel linears, LM head and router; canonical K-shards "
            "folded left to right for row-parallel linears; tiles free per batch-size bucket (checked)",
            "attention": f"two-level merge tree: {ta.CHUNK}-key chunks from position 0, inside a chunk "
            f"{ta.TILE}-key tiles by FlashAttention's online recurrence (one accumulator, {ta.BLOCK_M} rows of "
            "queries x GQA heads), chunk states (m,l,acc) merged in key order; p rounded to the KV dtype",
            "rms_norm": "fp32 div_rn(sum(x^2), K), div_rn(x, sqrt_rn(var+eps))*w, one rounding",
            "swiglu": "fp32 div_rn(g, 1+exp(-g))*u, one rounding",
            "rope": "fp32 x*cos + rotate_half(x)*sin, cos/sin tables of the contract set (CPU-built)",
            "logits": "fp32",
            "logprobs": f"fp32 log_softmax(div_rn(logits[:vocab], T)) in {trow.LOGPROB_BLOCK}-wide lanes",
            "fp_fusion": False,
            # Only under fp8_block: the unquantized set keeps the fingerprint it had before it took quant.
            **({"quant": self.quant, "fp8_block": _FP8_DESCRIPTION} if self.fp8 else {}),
        }

    # --- linear -------------------------------------------------------------------------------
    # Under fp8_block the attention and MLP linears (not the LM head or router) run fp8_linear, with the
    # straight-through backward of the ordered set's (ordered_quant) for callers that differentiate them.
    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        if self.fp8:
            return _ste(x, weight, lambda a, w: tfp8.fp8_partials(a, w, num_shards))
        return tlin.partials(x, weight.detach(), num_shards)

    def combine_partials(self, partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return tlin.fold(partials, out_dtype)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: RowParts | None = None,
        reduce_amax: AmaxReduce | None = None,
    ) -> torch.Tensor:
        """Column-parallel: K whole, one chain. `rows` / `reduce_amax` (fp8_block only): the HF weights the
        rows come from and the max over the ranks holding the rest of their blocks, as the ordered set's."""
        if self.fp8:
            return _ste(x, weight, lambda a, w: tfp8.fp8_linear(a, w, 1, x.dtype, rows, reduce_amax))
        return tlin.linear(x, weight.detach(), 1, x.dtype)

    def linear_k_sharded(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return _ste(x, weight, lambda a, w: tfp8.fp8_linear(a, w, self.canonical_shards, x.dtype))
        return tlin.linear(x, weight.detach(), self.canonical_shards, x.dtype)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return tlin.linear(x, weight.detach(), 1, torch.float32)

    # --- norms / activations / rotary ----------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _run(lambda a, w: trow.rms_norm(a, w, eps), lambda a, w: ref.rms_norm(a, w, eps), x, weight)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _run(trow.swiglu, ref.swiglu, gate, up)

    # The trainer's fused backward of the two (trainer.kernel_autograd finds them on the bound forward).
    def rms_norm_backward(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor, need_dw: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return trow_bwd.rms_norm_backward(x, weight, eps, grad, need_dw)

    def swiglu_backward(
        self, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return trow_bwd.swiglu_backward(gate, up, grad)

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.rope_cos_sin(positions, head_dim, theta)

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _run(lambda a: trow.apply_rope(a, cos, sin), lambda a: ref.apply_rope(a, cos, sin), x)

    def apply_rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)

    # --- attention ------------------------------------------------------------------------------
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return self.attention_batched(q[None], k[None], v[None], q_pos[None], k_pos[None], scale)[0]

    def attention_batched(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        b, nk = k.shape[:2]
        index = (torch.arange(b, device=q.device) * nk)[:, None] + torch.arange(nk, device=q.device)
        return ta.attention_indexed(
            q,
            q_pos,
            k.reshape(b * nk, *k.shape[2:]),
            v.reshape(b * nk, *v.shape[2:]),
            index,
            k_pos,
            torch.full((b,), nk, device=q.device),
            scale,
        )

    def attention_pooled(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        num_keys: int,
        scale: float,
    ) -> torch.Tensor:
        """q [B, Nq, Hq, D] over a KV pool [slots, cap, Hkv, D] (key j at position j of its slot)."""
        s, cap = k_pool.shape[:2]
        keys = torch.arange(num_keys, device=q.device)
        b = q.shape[0]
        index = slots.to(q.device)[:, None] * cap + keys
        return ta.attention_indexed(
            q,
            q_pos,
            k_pool.view(s * cap, *k_pool.shape[2:]),
            v_pool.view(s * cap, *v_pool.shape[2:]),
            index,
            keys.expand(b, -1),
            torch.full((b,), num_keys, device=q.device),
            scale,
        )

    # --- the trainer's attention: forward with its log-sum-exp, FlashAttention's backward ----------------
    def attention_with_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tab.forward_with_lse(q, k, v, positions, scale)

    def attention_backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        grad: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tab.backward(q, k, v, positions, out, lse, grad, scale)

    kv_pool_layout = "token"

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The kernel reads keys/values in the model dtype (tensor-core operands)."""
        return dtype

    def attention_tile_partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> AttnPartial:
        """The state of one tile: a chunk's state when the chunk holds that one tile."""
        if k.shape[0] != self.attention_tile:
            raise ValueError(f"attention_tile_partial takes exactly {self.attention_tile} keys, got {k.shape[0]}")
        return self.attention_chunk_partial(q, k, v, q_pos, k_pos, scale)

    def attention_chunk_partial(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        scale: float,
    ) -> AttnPartial:
        """The (m, l, acc) state of one chunk: k/v [n, Hkv, D] are its keys from its first, n <= attention_chunk
        (fewer only for the sequence's last chunk), merged with `merge` in key order (ring CP)."""
        n = k.shape[0]
        if not 0 < n <= self.attention_chunk:
            raise ValueError(f"attention_chunk_partial takes 1 to {self.attention_chunk} keys, got {n}")
        m, den, acc = ta.attention_indexed(
            q[None],
            q_pos[None],
            k,
            v,
            torch.arange(n, device=q.device)[None],
            k_pos[None],
            torch.full((1,), n, device=q.device),
            scale,
            partial=True,
        )
        return AttnPartial(m[0], den[0], acc[0])

    def merge(self, a: AttnPartial, b: AttnPartial) -> AttnPartial:
        return AttnPartial(*ta.merge(tuple(a), tuple(b)))

    def finalize(self, p: AttnPartial, dtype: torch.dtype) -> torch.Tensor:
        return ta.finalize(p.l, p.acc, dtype)

    # --- mixture of experts ---------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return tlin.linear(x, weight.detach(), 1, torch.float32)

    def route(self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> moe.Routing:
        return moe.contract_route(logits, top_k, norm_topk_prob)

    def moe_combine(self, outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return moe.contract_combine(outputs, weights, out_dtype)

    def describe_moe(self) -> dict[str, Any]:
        d = dict(moe.DESCRIPTION)
        if self.fp8:
            d["experts_quant"] = "fp8_block: the experts' gate/up and down as the dense linears"
        return d

    # --- logprobs -------------------------------------------------------------------------------
    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        return _run(
            lambda x: trow.logprobs(x, tokens, vocab_size, temperature),
            lambda x: ref.logprobs(x, tokens, vocab_size, temperature),
            logits,
        )
