"""How the TP ranks of a row-parallel linear (o_proj, down) combine their canonical K-shard partials.

Both engines' row-parallel linears end here (the Megatron layer spec, the SGLang model package), so the
contract's sum over K-shards is put together one way whatever the TP. Every rank holds the partials of
its own consecutive canonical shards. Where the kernel set's tree splits at rank boundaries
(`fold_partials`: the invariant set's pairwise tree over a power-of-two group per rank), a rank sums its
own subtree first and only the fp32 subtree sums cross ranks: at TP=2 one all-reduce, whose single IEEE
addition per element gives both ranks the tree's top node (a + b == b + a), at TP=4 a gather of the four
subtree sums for the tree's last levels. Otherwise every partial is gathered in rank order and combined.
Measured (experiments/bench/bench_trainer.py, 2-core CPU, gloo, five runs): TP2 trainer step 1.17x -> 1.04-1.14x
stock in fp32, 1.15x -> 1.10-1.13x in bf16, against gathering every partial.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tonpolicy.kernels.base import KernelSet


def gather_in_rank_order(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def combine_row_parallel(
    kernels: KernelSet, partials: torch.Tensor, out_dtype: torch.dtype, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The row-parallel linear's output from this rank's partials [C/TP, ..., N]: bitwise
    `kernels.combine_partials` of every rank's partials stacked in rank order. No autograd: both callers
    run it in a forward whose backward is written out (or under no_grad)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return kernels.combine_partials(partials, out_dtype)
    fold = getattr(kernels, "fold_partials", None)
    local = fold(partials) if fold is not None else None
    if local is None:
        return kernels.combine_partials(gather_in_rank_order(partials, group), out_dtype)
    if world == 2:
        local = local.contiguous()
        dist.all_reduce(local, group=group)
        return kernels.combine_partials(local[None], out_dtype)
    return kernels.combine_partials(gather_in_rank_order(local[None], group), out_dtype)
