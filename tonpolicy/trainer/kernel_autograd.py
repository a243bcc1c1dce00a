"""Autograd for the kernel calls: the kernel set's forward, the textbook (plain torch) backward.

Only the forward is under the numerics contract (the logprobs must match the rollout bit for bit).
Differentiating through the contract kernels' tiling (row-tile padding, canonical K-shard stacks,
split-KV partials) costs far more than the math needs, so these autograd functions run the kernel in
the forward and the textbook gradient of the same function in the backward: dX = dY W, dW = dY^T X
for linears, softmax-attention's gradient (via SDPA) for attention. The gradients are mathematically
those of the forward; they are not bitwise invariant across layouts (state tolerances, not equality).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _linear_grads(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x, w = ctx.saved_tensors
    g = grad.to(x.dtype)
    dx = g.matmul(w.to(x.dtype)) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        dw = g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])).to(w.dtype)
    return dx, dw


class KernelLinear(torch.autograd.Function):
    """y = kernels.linear(x, w) (or the fp32 LM head) with the plain linear backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fn: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return fn(x, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        dx, dw = _linear_grads(ctx, grad)
        return dx, dw, None


def _plain_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [(B,) s, Hq, D], k/v [(B,) s, Hkv, D], positions [(B,) s]."""
    if q.dim() == 3:
        return _plain_attention(q[None], k[None], v[None], positions[None], scale)[0]
    g = q.shape[2] // k.shape[2]
    if torch.equal(positions, torch.arange(positions.shape[1], device=positions.device).expand_as(positions)):
        mask, causal = None, True  # whole sequences from position 0: the fast causal path
    else:
        mask, causal = (positions[:, None, :] <= positions[:, :, None])[:, None], False  # key j visible to query i
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(g, dim=2).transpose(1, 2),
        v.repeat_interleave(g, dim=2).transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2)


class KernelAttention(torch.autograd.Function):
    """Causal attention of whole sequences ([s, ...] or a batch [B, s, ...]): the kernel set's forward,
    SDPA-gradient backward."""

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
        with torch.enable_grad():
            qd, kd, vd = (t.detach().float().requires_grad_() for t in (q, k, v))
            out = _plain_attention(qd, kd, vd, positions, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), grad.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
