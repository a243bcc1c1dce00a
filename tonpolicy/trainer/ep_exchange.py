"""Expert parallelism's token exchange, tonpolicy's own (as its context parallelism is): megatron-core's
dispatchers do not run here (the all-to-all one passes its split sizes as tensors, which gloo's
`all_to_all_single` refuses; an uneven all-gather fails on gloo).

Exact by construction. Every EP rank all-gathers the tokens and routes of its EP group (padded to the
largest token count, the counts exchanged first: gloo gathers even sizes only); each rank computes its
own experts for every gathered (token, slot) routed to them into an fp32 [T_all, k, H] buffer that holds
-0.0 elsewhere; the buffers are summed over the group. Exactly one rank writes each (token, slot), and
-0.0 + y == y for every fp32 y (signed zeros and NaNs included; +0.0 would turn a -0.0 output into +0.0),
in any summation order: each rank gets back its own tokens' expert outputs bit for bit, as if every
expert were local. The combine (`kernels.moe_combine`) then runs on the token's own rank.

Backward (every rank takes part in both collectives, whether or not its experts got tokens): the sum's
is a sum of the gradients over the group (every rank's buffer reaches every rank);
the gather's sums each rank's gradients of the gathered rows over the group and keeps its own rows.
Gradients are summed in fp32 (not bitwise across EP sizes: the state tolerance, not equality).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# compute(tokens [T, H], experts [T, k] (ids, -1 for a padding row)) -> [T, k, H] fp32, -0.0 in every
# slot whose expert is not this rank's.
ExpertCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def empty_outputs(experts: torch.Tensor, hidden: int, device: torch.device) -> torch.Tensor:
    """The [T, k, H] fp32 buffer a rank writes its experts' outputs into: -0.0, the identity of the sum."""
    return torch.full((*experts.shape, hidden), -0.0, dtype=torch.float32, device=device)


class _GatherRows(torch.autograd.Function):
    """[n, H] on each rank -> [world * m, H]: rank r's rows at [r*m, r*m + n_r), zeros after them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m: int, group: dist.ProcessGroup) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.rows = group, (rank * m, x.shape[0])
        padded = torch.cat([x, x.new_zeros(m - x.shape[0], *x.shape[1:])]) if m > x.shape[0] else x
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.float().contiguous()
        dist.all_reduce(total, group=ctx.group)
        start, n = ctx.rows
        return total[start : start + n].to(grad.dtype), None, None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _KeepInGraph(torch.autograd.Function):
    """outputs, unchanged; its backward hands `gathered` a zero gradient. A rank whose experts got none
    of the gathered tokens computes an outputs buffer with no autograd history: without this, its
    backward would skip the sum's and the gather's collectives that the other EP ranks wait in."""

    @staticmethod
    def forward(ctx: Any, outputs: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return outputs.view_as(outputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def gather_ints(x: torch.Tensor, m: int, group: dist.ProcessGroup, fill: int) -> torch.Tensor:
    """Integer rows [n, ...] -> [world * m, ...], each rank's padded with `fill` (no autograd)."""
    padded = torch.cat([x, x.new_full((m - x.shape[0], *x.shape[1:]), fill)]) if m > x.shape[0] else x
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts)


def routed_outputs(
    compute: ExpertCompute, tokens: torch.Tensor, experts: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every local token's k expert outputs [n, k, H] fp32, the experts spread over the EP `group`."""
    if group is None or dist.get_world_size(group) == 1:
        return compute(tokens, experts)
    dev = tokens.device  # NCCL collectives need device tensors
    counts = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([tokens.shape[0]], dtype=torch.long, device=dev), group=group)
    m = int(max(c.item() for c in counts))
    gathered = _GatherRows.apply(tokens, m, group)
    routes = gather_ints(experts, m, group, fill=-1)  # padding rows go to no expert
    outputs = _SumOverGroup.apply(_KeepInGraph.apply(compute(gathered, routes), gathered), group)
    start = dist.get_rank(group) * m
    return outputs[start : start + tokens.shape[0]]
