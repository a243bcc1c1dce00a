"""Gradient norm over a (TP/PP-sharded) megatron model, counting every weight exactly once."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared


def grads_for_norm(model: torch.nn.Module) -> list[torch.Tensor]:
    """Same filter as megatron's optimizer: skip TP replicas (counted on TP rank 0) and shared copies."""
    out = []
    for p in model.parameters():
        grad = getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
        if grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            out.append(grad.float())
    return out


def grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of all gradients across TP and PP (grads must already be reduced over DP/CP)."""
    return float(
        get_grad_norm_fp32(grads_for_norm(model), grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    )
