"""Autograd-aware collectives used by the kernel layer spec (gloo and NCCL alike)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _ReplicatedAllGather(torch.autograd.Function):
    """All-gather along `dim` in rank order. The consumer is replicated (every rank computes the same
    thing from the gathered tensor), so the backward narrows the gradient to the local piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.rank, ctx.dim, ctx.width = dist.get_rank(group), dim, x.shape[dim]
        if world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width).contiguous(), None, None


def replicated_all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReplicatedAllGather.apply(x, dim, group)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Split `scatter_dim` into world pieces (piece r goes to rank r), concatenate what arrives along
    `gather_dim` in rank order. The backward is the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send `x` to the rank `step` places ahead in `group`, receive from the one `step` behind."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + step) % world)
    recv_from = dist.get_global_rank(group, (rank - step) % world)
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), send_to, group), dist.P2POp(dist.irecv, out, recv_from, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out
