"""Linears of the `invariant` kernel set: the contract GEMM (tonpolicy.kernels.invariant.exact_gemm) per canonical
K-shard, and the fixed pairwise tree that sums the shards.

- Every GEMM is the exact fixed-point product of exact_gemm: a row's bits depend on that row and the
  weight alone, whatever the row count, row position, column shard, thread count, CPU or BLAS; so no
  row tiles, padding or library settings are needed (earlier versions relied on measured MKL/oneDNN
  behaviour, which failed on an Ice Lake Xeon).
- K is cut into `C` canonical shards; each shard's partial is the same whatever the TP, and `tree_sum`
  adds them in fp32 in a fixed pairwise tree, so TP=1/2/4 give the same bits.
"""

from __future__ import annotations

import torch

from tonpolicy.kernels.invariant import exact_gemm, exact_gemv


def tiled_partials(x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
    """fp32 partials [num_shards, ..., N] of x [..., K] @ weight[N, K].T over equal K shards."""
    return exact_gemm.linear_partials(x, weight, num_shards)


# Elements per row block of a large untracked tree sum: the block's fp32 temporaries stay in cache, where
# whole-tensor temporaries of a long prefill stream through memory (experiments/bench/bench_engine.py
# measures the prefill). Elementwise adds: the same bits.
SUM_BLOCK = 1 << 16


def tree_sum(partials: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum along dim 0 in fp32 in a fixed pairwise tree: ((p0+p1)+(p2+p3)) for 4 partials; the fp32 sum
    rounded once to `out_dtype`."""
    tracked = torch.is_grad_enabled() and partials.requires_grad
    if not tracked and partials.shape[0] > 1:  # decode sizes: one compiled call, the same fp32 adds
        fast = exact_gemv.tree_sum(partials)
        if fast is not None:
            return fast.to(out_dtype)
    n = partials.shape[-1]
    rows = partials[0].numel() // max(n, 1)
    block = max(4, SUM_BLOCK // max(n, 1))
    if tracked or partials.shape[0] == 1 or rows <= 2 * block:
        return _tree(partials, tracked).to(out_dtype)
    flat = partials.reshape(partials.shape[0], rows, n)
    out = partials.new_empty(rows, n, dtype=out_dtype)
    for a in range(0, rows, block):
        out[a : a + block] = _tree(flat[:, a : a + block], False)
    return out.view(partials.shape[1:])


def _tree(partials: torch.Tensor, tracked: bool) -> torch.Tensor:
    parts = list(partials.unbind(0))
    if len(parts) == 1:
        return parts[0].float()
    # The first level makes fresh fp32 sums (a bf16 operand is upcast exactly); later levels add into
    # them in place: the same bits, without page-faulting fresh buffers for every sum.
    level = [parts[i].float() + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
    if len(parts) % 2:
        level.append(parts[-1].float())  # an odd one out is only ever added, never added into
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] if tracked else level[i].add_(level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]
