"""The trainer's fp8_block weight parts: which Hugging Face weights a rank's fused rows come from, and the
exact all-reduce of the block amaxes a TP split leaves on several ranks.

Megatron fuses [gate; up] (the dense MLP's fc1 and every expert's) and [q; k; v] per TP rank; fp8_block
quantizes each HF weight in its own 128-row blocks, so a rank's rows are its slice of each HF weight
(`RowParts.tp_shard`), and a block cut by the TP split takes the max of every rank's partial amax (an
all-reduce MAX: exact and order-free), then each rank quantizes its rows by the same formula. The kernel
set is handed the reduce as a function; it holds no process group. Without fp8 these are the plain
kernel column-parallel linears."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tonpolicy.kernels.fp8_block import amax_all_reduce
from tonpolicy.trainer.kernel_autograd import KernelLinear
from tonpolicy.trainer.kernel_modules import KernelColumnParallelLinear, tp_dgrad_group


def fp8_parts(sizes: list[int], group: Any) -> tuple[Any, Any]:
    """(RowParts, reduce) of a rank's fused slices of HF weights with `sizes` rows, split over `group`."""
    from tonpolicy.kernels.invariant.ordered_fp8 import RowParts

    rank, tp = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    return RowParts.tp_shard(sizes, rank, tp), amax_all_reduce(group)


class KernelGateUpLinear(KernelColumnParallelLinear):
    """A fc1 of [gate; up] (this rank's slice of each): under fp8_block, gate and up quantized as the two HF
    weights they are."""

    def _group(self) -> Any:
        """The group fc1's rows are split over (None at one rank)."""
        return tp_dgrad_group()

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        group = self._group()
        if not getattr(self.kernels, "fp8", False):
            return KernelLinear.apply(input_, w, self.kernels.linear, group), None
        tp = 1 if group is None else dist.get_world_size(group)
        rows, reduce = fp8_parts([w.shape[0] // 2 * tp] * 2, group)

        def fn(x: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
            return self.kernels.linear(x, w_, rows, reduce)

        return KernelLinear.apply(input_, w, fn, group), None
