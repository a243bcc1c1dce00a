"""Autograd for the kernel calls: the kernel set's forward, the textbook (plain torch) backward.

Only the forward is under the numerics contract (the logprobs must match the rollout bit for bit).
Differentiating through the contract kernels' tiling (row-tile padding, canonical K-shard stacks,
split-KV partials) costs far more than the math needs, so these autograd functions run the kernel in
the forward and the textbook gradient of the same function in the backward: dX = dY W, dW = dY^T X
for linears, softmax attention's (written out: no autograd graph of a recompute) for attention. The
gradients are mathematically those of the forward; they are not bitwise invariant across layouts
(state tolerances, not equality).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from tonpolicy.kernels.invariant.kernel_set import value_key


def _linear_grads(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x, w = ctx.saved_tensors
    g = grad.to(x.dtype)
    dx = g.matmul(w.to(x.dtype)) if ctx.needs_input_grad[0] else None
    # A column-parallel linear's dX is summed over TP: started here, it runs while dW is computed
    # (megatron's own linear overlaps them the same way; synchronous, it doubled the step's wait).
    pending = dist.all_reduce(dx, group=ctx.dgrad_group, async_op=True) if dx is not None and ctx.dgrad_group else None
    dw = None
    if ctx.needs_input_grad[1]:
        dw = g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])).to(w.dtype)
    if pending is not None:
        pending.wait()
    return dx, dw


class KernelLinear(torch.autograd.Function):
    """y = kernels.linear(x, w) (or the fp32 LM head) with the plain linear backward. `dgrad_group`: the
    TP group of a column-parallel linear (its input is replicated: dX is all-reduced over the group)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fn: Any, dgrad_group: Any = None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.dgrad_group = dgrad_group
        return fn(x, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        dx, dw = _linear_grads(ctx, grad)
        return dx, dw, None, None


def _fused_backward(fn: Any, name: str) -> Any:
    """The kernel set's own fused backward of a row-local op (`fn` is the set's bound method), or None:
    the textbook formula below (the same gradient, one launch instead of a dozen)."""
    return getattr(getattr(fn, "__self__", None), name, None)


class KernelRMSNorm(torch.autograd.Function):
    """y = kernels.rms_norm(x, w, eps) with RMSNorm's textbook backward in fp32 (no graph of the
    forward's elementwise ops: a fraction of the calls)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float, fn: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        ctx.fused = _fused_backward(fn, "rms_norm_backward")
        return fn(x, w, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, w = ctx.saved_tensors
        if ctx.fused is not None:
            dx, dw = ctx.fused(x, w, ctx.eps, grad, ctx.needs_input_grad[1])
            return dx, dw, None, None
        xf = x.float()
        # IEEE ops only (sqrt, division), as the forward: an element's bits never depend on the tensor's length
        r = torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + ctx.eps).reciprocal_()
        xr = xf * r  # the normalised input
        g = grad.float()
        dw = (g * xr).reshape(-1, x.shape[-1]).sum(0).to(w.dtype) if ctx.needs_input_grad[1] else None
        dx = None
        if ctx.needs_input_grad[0]:
            u = g * w.float()
            dx = ((u - xr * (u * xr).mean(dim=-1, keepdim=True)) * r).to(x.dtype)
        return dx, dw, None, None


class KernelSwiGLU(torch.autograd.Function):
    """y = kernels.swiglu(gate, up) = silu(gate) * up with its textbook backward in fp32."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, fn: Any) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.fused = _fused_backward(fn, "swiglu_backward")
        return fn(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gate, up = ctx.saved_tensors
        if ctx.fused is not None:
            return (*ctx.fused(gate, up, grad), None)
        gf, g = gate.float(), grad.float()
        # exp, not torch.sigmoid: sigmoid's scalar-tail and vector paths differ, so a tensor's length
        # (a CP rank's share of the sequence) would change an element's bits
        sig = torch.exp(-gf).add_(1.0).reciprocal_()
        d_up = (g * gf * sig).to(up.dtype)
        d_gate = (g * up.float() * sig * (1.0 + gf * (1.0 - sig))).to(gate.dtype)
        return d_gate, d_up, None


# Queries x keys of one block of the backward (scores and their gradients held at once, per head): bounds
# its memory for long sequences. A function of the sequence length alone, so that every layout that
# keeps a head's sequence whole (TP, PP, Ulysses CP) sums dK/dV over the same blocks.
GRAD_BLOCK = 1 << 17


# The last positions' causal biases by query block (every layer of a backward pass asks for the same),
# up to BIAS_CACHE fp32 elements: long sequences compute the rest per call.
_BIAS: dict[tuple, torch.Tensor] = {}
BIAS_CACHE = 1 << 22


def _causal_bias(positions: torch.Tensor, values: tuple, a: int, e: int) -> torch.Tensor:
    """[B, e-a, s] fp32: 0 where key j is visible to query i in [a, e), else -inf (added to the scores:
    a broadcast masked_fill is slow). `values`: the positions' cache key (taken once per call)."""
    key = (values, a, e)
    if key in _BIAS:
        return _BIAS[key]
    if any(k[0] != values for k in _BIAS):
        _BIAS.clear()
    hidden = positions[:, None, :] > positions[:, a:e, None]
    bias = torch.zeros(hidden.shape, device=positions.device).masked_fill_(hidden, -math.inf)
    if sum(b.numel() for b in _BIAS.values()) + bias.numel() <= BIAS_CACHE:
        _BIAS[key] = bias
    return bias


def attention_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, grad: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, fp32) of causal softmax attention, key j visible to query i iff
    positions[j] <= positions[i] (every query sees itself): q/grad [B, s, Hq, D], k/v [B, s, Hkv, D],
    positions [B, s]. The textbook backward, written out: scores and probabilities recomputed per block
    of queries, each KV head's query group as rows of one GEMM (no repeated keys), no autograd graph."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    # GEMM operands in bf16 when the activations are (as megatron's own attention backward runs them),
    # softmax and its gradient in fp32.
    mm = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    # [B, Hkv, G, s, D] queries and their gradients; [B, Hkv, s, D] keys and values.
    qm, gm = (t.to(mm).view(b, n, hkv, g, d).permute(0, 2, 3, 1, 4) for t in (q, grad))
    km, vm = (t.to(mm).transpose(1, 2) for t in (k, v))
    dq = q.new_empty(b, hkv, g, n, d, dtype=torch.float32)
    dk, dv = dq.new_zeros(b, hkv, n, d), dq.new_zeros(b, hkv, n, d)
    block = max(1, GRAD_BLOCK // n)
    values = (positions.shape, positions.dtype, positions.device, value_key(positions))
    for a in range(0, n, block):
        e = min(n, a + block)
        rows = g * (e - a)
        qb = qm[:, :, :, a:e].reshape(b, hkv, rows, d)
        gb = gm[:, :, :, a:e].reshape(b, hkv, rows, d)
        bias = _causal_bias(positions, values, a, e)
        s = torch.matmul(qb, km.transpose(-1, -2)).float().mul_(scale).view(b, hkv, g, e - a, n)
        p = torch.softmax(s.add_(bias[:, None, None]), dim=-1).view(b, hkv, rows, n)
        pm = p.to(mm)
        dv += torch.matmul(pm.transpose(-1, -2), gb)
        dp = torch.matmul(gb, vm.transpose(-1, -2)).float()
        ds = dp.sub_((dp * p).sum(-1, keepdim=True)).mul_(p).mul_(scale).to(mm)  # softmax backward, scaled
        dq[:, :, :, a:e] = torch.matmul(ds, km).view(b, hkv, g, e - a, d)
        dk += torch.matmul(ds.transpose(-1, -2), qb)
    return dq.permute(0, 3, 1, 2, 4).reshape(b, n, hq, d), dk.transpose(1, 2), dv.transpose(1, 2)


class KernelAttention(torch.autograd.Function):
    """Causal attention of whole sequences ([s, ...] or a batch [B, s, ...]): the kernel set's forward,
    the textbook softmax-attention backward (`attention_grads`)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, fn: Any
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, positions)
        ctx.scale = scale
        return fn(q, k, v, positions)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, positions = ctx.saved_tensors
        one = q.dim() == 3  # a single sequence [s, H, D]
        args = (t[None] if one else t for t in (q, k, v, positions, grad))
        dq, dk, dv = (t[0] if one else t for t in attention_grads(*args, ctx.scale))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class FlashKernelAttention(torch.autograd.Function):
    """Causal attention of whole sequences ([s, ...] or a batch [B, s, ...]) for a kernel set with a
    FlashAttention backward: the forward is the set's contract kernel returning its log-sum-exp too
    (`kernels.attention_with_lse`), the backward `kernels.attention_backward` from that output and
    log-sum-exp (no probability blocks written out; gradients are not under the contract)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, kernels: Any
    ) -> torch.Tensor:
        one = q.dim() == 3  # a single sequence [s, H, D]
        args = [t[None] if one else t for t in (q, k, v, positions)]
        out, lse = kernels.attention_with_lse(*args, scale)
        ctx.save_for_backward(*args, out, lse)
        ctx.scale, ctx.kernels, ctx.one = scale, kernels, one
        return out[0] if one else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, positions, out, lse = ctx.saved_tensors
        grads = ctx.kernels.attention_backward(q, k, v, positions, out, lse, grad[None] if ctx.one else grad, ctx.scale)
        dq, dk, dv = (t[0] if ctx.one else t for t in grads)
        return dq, dk, dv, None, None, None
