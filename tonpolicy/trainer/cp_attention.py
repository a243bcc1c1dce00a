"""Causal attention of one sequence under context parallelism, bitwise equal to the single-device
contract kernel.

- cp == 1: `kernels.attention` directly.
- Ulysses: all-to-all scatters heads and gathers the (contiguous) sequence chunks, so each rank runs
  the single-device kernel on whole sequences for H/CP heads (heads are independent), then back.
- ring (zigzag): `ring_attention.RingAttention` (K/V travel the ring; remote chunk partials merged
  in the single-device key order).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state

from tonpolicy.trainer.comm import all_to_all
from tonpolicy.trainer.kernel_autograd import FlashKernelAttention, KernelAttention
from tonpolicy.trainer.ring_attention import RingAttention


def context_parallel_attention(
    kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, cp_type: str
) -> torch.Tensor:
    """q [s_local, Hq, D], k/v [s_local, Hkv, D] (RoPE applied), positions [s_local] -> [s_local, Hq, D]."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return _attention(kernels, q, k, v, positions, scale)
    group = parallel_state.get_context_parallel_group()
    if cp_type == "ulysses":
        return _ulysses(kernels, q, k, v, scale, cp, group)
    if cp_type == "ring":
        return _ring(kernels, q, k, v, positions, scale, cp, group)
    raise ValueError(f"unknown CP type {cp_type!r}")


def batched_attention(
    kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows of one whole sequence each, no CP: q [B, s, Hq, D], k/v [B, s, Hkv, D], positions [B, s]."""

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return kernels.attention_batched(q, k, v, positions, positions, scale)

    return _autograd(kernels, q, k, v, positions, scale, fwd)


def _attention(
    kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """`kernels.attention` over one whole sequence (forward), plain attention gradient (backward)."""

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return kernels.attention(q, k, v, positions, positions, scale)

    return _autograd(kernels, q, k, v, positions, scale, fwd)


def _autograd(
    kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, fwd: Any
) -> torch.Tensor:
    """The set's FlashAttention backward where it has one (the forward then also keeps its log-sum-exp:
    only when a gradient is wanted), else the textbook backward."""
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if wants_grad and hasattr(kernels, "attention_backward"):
        return FlashKernelAttention.apply(q, k, v, positions, scale, kernels)
    return KernelAttention.apply(q, k, v, positions, scale, fwd)


def _ulysses(
    kernels: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cp: int, group: Any
) -> torch.Tensor:
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"Ulysses CP={cp} must divide the local query ({q.shape[1]}) and KV ({k.shape[1]}) heads")
    # [s/cp, H, D] -> [s, H/cp, D]; chunks arrive in rank order = sequence order (contiguous layout).
    qf, kf, vf = (all_to_all(t, scatter_dim=1, gather_dim=0, group=group) for t in (q, k, v))
    out = _attention(kernels, qf, kf, vf, torch.arange(qf.shape[0], device=qf.device), scale)
    return all_to_all(out, scatter_dim=0, gather_dim=1, group=group)


def _ring(
    kernels: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    cp: int,
    group: Any,
) -> torch.Tensor:
    return RingAttention.apply(q, k, v, positions, scale, kernels)
