"""The package's column-parallel linears under contract.quant=fp8_block: which Hugging Face weights a
rank's fused rows come from.

fp8_block quantizes each HF weight in its own 128-row blocks; the package fuses [q; k; v] and [gate; up] per
TP rank, so it tells the kernel set which rows are which weight's (`RowParts`), and hands it the exact
all-reduce MAX over the TP group that a block cut by the TP split needs (the trainer's way,
`trainer/fp8_gate_up.py`). Every rank of the group runs the same linears on the same weights version, so
their quantizations (and the collective in them) happen together. Without fp8 this is the plain linear.
"""

from __future__ import annotations

from typing import Any

import torch


def fused_column_linear(
    kernels: Any,  # noqa: ANN401 - a kernel set
    x: torch.Tensor,
    w: torch.Tensor,
    parts: tuple[tuple[int, int, int], ...],
    group: Any,  # noqa: ANN401 - a torch process group or None
) -> torch.Tensor:
    """x against this rank's fused rows `w`; `parts`: per HF weight, in order, (rows here, the first one's
    row in its HF weight, that weight's rows); `group`: the ranks holding the other rows (None: one)."""
    if not getattr(kernels, "fp8", False):
        return kernels.linear(x, w)
    from tonpolicy.kernels.fp8_block import amax_all_reduce
    from tonpolicy.kernels.invariant.ordered_fp8 import RowParts

    return kernels.linear(x, w, RowParts(parts), amax_all_reduce(group))
