"""The `triton` set's fp8_block GEMM (triton/fp8_linear.py) in Triton's interpreter: its e4m3 `tl.dot` gives
the exact sum where every partial sum is exact; a row's bits do not depend on the batch (1 row, a few,
and a count in the larger tile bucket), on the tile, or on the route (K whole, canonical shards, the kernel
set's row-parallel linear = the fold of its partials), and the family check a GPU runs first passes. Negative
controls: the same GEMM with one activation scale per tensor (a batch-dependent quantization) gives a row
other bits when the batch changes; a family member that sums a group in two dots is refused. The
end-to-end proof (engine decode = prefill, trainer TP1/TP2 = engine) is tests/align/test_triton_parity.py."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.fp8_block import BLOCK, E4M3_MAX
from tonpolicy.kernels.triton import fp8_linear as tfp8
from tonpolicy.kernels.triton import linear as tlin

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
K, N = 384, 80  # three 128-groups; 4 canonical shards of 96 (one partial group each); two column tiles


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_fp8_dot_is_the_exact_sum_when_sums_are_exact() -> None:
    """Small integers (exact in e4m3, every partial sum exact in fp32), unit scales: the exact result. A
    ragged last group (K = 200) reads masked zeros."""
    g = torch.Generator().manual_seed(1)
    qa = torch.randint(-8, 9, (3, 200), generator=g).float()
    qw = torch.randint(-8, 9, (N, 200), generator=g).float()
    ones_a, ones_w = torch.ones(3, 2), torch.ones(N, 2)
    e4 = torch.float8_e4m3fn
    got = tfp8.gemm_partials(qa.to(e4), ones_a, qw.to(e4).contiguous(), ones_w, 1)[0]
    assert torch.equal(got, (qa.double() @ qw.double().t()).float())


def test_fp8_rows_invariant_to_batch_tile_and_route() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, K, generator=g)
    w = torch.randn(N, K, generator=g) / 16
    kern = get_kernels("triton", attention_tile=64, quant="fp8_block")
    whole = kern.linear(x, w)
    sharded = kern.linear_k_sharded(x, w)
    assert tfp8.fp8_tiles_for(1) != tfp8.fp8_tiles_for(70)  # the rows cross the tile buckets
    for lo, hi in ((0, 1), (5, 8), (66, 67)):
        assert torch.equal(_bits(kern.linear(x[lo:hi], w)), _bits(whole[lo:hi]))
        assert torch.equal(_bits(kern.linear_k_sharded(x[lo:hi], w)), _bits(sharded[lo:hi]))
    # The row-parallel linear is the set's fold of its partials (the trainer's route at any TP).
    parts = kern.linear_partials(x, w, 4)
    assert torch.equal(_bits(kern.combine_partials(parts, torch.float32)), _bits(sharded))
    # Another tile member for the same rows: the same bits.
    qw, sw = tfp8.packed_weight(w, 1, None, None)
    qa, sa = tfp8.quantize_activations(x, 1)
    other = tfp8.gemm_partials(qa, sa, qw, sw, 1, tiles=tfp8.Fp8Tiles(128, 64, 4))[0]
    assert torch.equal(_bits(other), _bits(whole))
    # FP8 is not the unquantized GEMM: close to it, other bits.
    plain = get_kernels("triton", attention_tile=64).linear(x, w)
    assert not torch.equal(plain, whole) and (plain - whole).abs().max() < 0.1 * plain.abs().max()


def test_control_batch_scaled_activations_change_a_row() -> None:
    """A per-tensor activation scale (the batch's amax) runs the same kernel: one row alone gets other bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, K, generator=g)
    x[4] *= 3  # the batch's largest row sets every row's scale
    w = torch.randn(N, K, generator=g) / 16
    qw, sw = tfp8.packed_weight(w, 1, None, None)

    def per_tensor(a: torch.Tensor) -> torch.Tensor:
        scale = a.abs().amax() / E4M3_MAX
        sa = scale.expand(a.shape[0], -(-K // BLOCK)).contiguous()
        return tfp8.gemm_partials((a / scale).to(torch.float8_e4m3fn), sa, qw, sw, 1)[0]

    batch, alone = per_tensor(x), per_tensor(x[:1])
    diff = (batch[0] - alone[0]).abs().max()
    assert not torch.equal(_bits(batch[0]), _bits(alone[0])) and 0 < diff < 0.1


def test_fp8_family_check_and_its_control() -> None:
    from dataclasses import replace

    cpu = torch.device("cpu")
    tfp8.check_fp8_family(cpu)
    two_dots = replace(tfp8.FP8_FAMILY[0], dot_k=BLOCK // 2)
    with pytest.raises(tlin.GemmFamilyMismatch, match="one MMA chain.*refusing"):
        tfp8.check_fp8_family(cpu, (tfp8.FP8_FAMILY[0], two_dots))
