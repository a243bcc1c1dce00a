"""The compiled GEMV of one stream's decode (tonpolicy.kernels.invariant.exact_gemv) gives exact_gemm's bits: the
same quantization and exact integer sums, read from the weight in its own dtype. Checked against the
torch path (exact_gemm.exact_matmul of the cached integer weight) on many shapes, dtypes, row counts 1..4,
odd K, shards, zero rows and wide magnitudes. Negative control: the plain library product of the same
operands differs, so the comparison sees a one-bit change."""

from __future__ import annotations

import itertools

import pytest
import torch

from tonpolicy.kernels import weights_updated
from tonpolicy.kernels.invariant import exact_gemm, exact_gemv

pytestmark = pytest.mark.skipif(exact_gemv.kernel() is None, reason="no C++ compiler: the torch path runs")

DTYPES = (torch.float32, torch.bfloat16)
SHAPES = [(1, 1, 5), (3, 1, 9), (37, 1, 33), (128, 1, 384), (128, 4, 130), (2052, 2, 17), (1024, 4, 64)]


def _torch_path(x: torch.Tensor, w: torch.Tensor, shards: int) -> torch.Tensor:
    k = x.shape[-1]
    qb, scale, bits_a, slices = exact_gemm.quantized_weight(w, shards, x.dtype)
    return exact_gemm.exact_matmul(x.reshape(-1, shards, k // shards).transpose(0, 1), qb, scale, bits_a, slices)


def _operands(m: int, k: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over 12 decades: many elements far below their line's max, which the quantization rounds.
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, k)[torch.randperm(k, generator=g)]
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, k)[torch.randperm(k, generator=g)]
    if m >= 2:
        x[1] = 0.0  # a zero row: scale 2^-bits, integers 0
    return x.to(x_dtype), w.to(w_dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_compiled_gemv_has_the_torch_paths_bits(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    for (k, shards, n), m in itertools.product(SHAPES, (1, 2, 3, 4)):
        x, w = _operands(m, k, n, x_dtype, w_dtype, seed=k * 7 + m)
        got = exact_gemv.linear_partials(x, w, shards)
        assert got is not None
        want = _torch_path(x, w, shards)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (k, shards, n, m)
        # What the kernels call goes through the compiled path for these rows, with the same bits.
        assert torch.equal(exact_gemm.linear_partials(x, w, shards).view(torch.int32), want.view(torch.int32))


def test_more_rows_or_a_strided_weight_take_the_torch_path() -> None:
    x, w = _operands(5, 64, 16, torch.float32, torch.float32, seed=1)
    assert exact_gemv.linear_partials(x, w, 1) is None  # 5 rows: the GEMM
    assert exact_gemv.linear_partials(x[:2], w.t().contiguous().t(), 1) is None
    assert torch.equal(exact_gemm.linear_partials(x[:2], w.t().contiguous().t(), 1), _torch_path(x[:2], w, 1))


def test_weight_updates_reach_the_column_scales() -> None:
    x, w = _operands(1, 64, 16, torch.bfloat16, torch.bfloat16, seed=2)
    before = exact_gemv.linear_partials(x, w, 1)
    w.mul_(4.0)  # bumps the version: new scales
    assert torch.equal(exact_gemv.linear_partials(x, w, 1), before * 4.0)
    w.data.mul_(0.5)  # no version bump: weights_updated() tells the caches
    weights_updated()
    assert torch.equal(exact_gemv.linear_partials(x, w, 1), before * 2.0)


def test_negative_control_the_library_product_differs() -> None:
    """The plain product of the same operands is not the contract's: the equality above can fail."""
    mismatched = 0
    for dt in DTYPES:
        x, w = _operands(1, 1024, 256, dt, dt, seed=3)
        contract = exact_gemv.linear_partials(x, w, 1)[0]
        plain = (x.float() @ w.float().t()) if dt == torch.float32 else (x @ w.t()).float()
        mismatched += int((contract.view(torch.int32) != plain.view(torch.int32)).sum())
    assert mismatched > 0


@pytest.mark.parametrize("source", DTYPES)
def test_compiled_attention_products_have_the_torch_paths_bits(source: torch.dtype) -> None:
    """Scores (matmul_as: B per column) and p @ v (pv_product: v per key, folded into p) for few rows,
    against exact_gemm's torch path; odd key counts, masked (zero) probabilities, all-zero rows."""
    _check_attention_products(source, ((1, 1, 32, 40), (8, 2, 32, 200), (3, 3, 64, 7), (5, 8, 17, 33), (2, 4, 1, 9)))


@pytest.mark.parametrize("source", DTYPES)
def test_many_rows_of_short_contractions_take_the_compiled_path_with_the_same_bits(source: torch.dtype) -> None:
    """The attention's products (`any_rows`: a prefill block's rows) in chunks of 16 / slices rows: row
    counts that are not a multiple of the chunk, contractions up to CHUNKED_MAX_K; longer ones, and a
    linear's (no `any_rows`), are left to the library GEMM."""
    _check_attention_products(source, ((2, 9, 32, 40), (4, 16, 32, 32), (3, 17, 128, 19), (1, 40, 5, 64)), True)
    a, b = torch.randn(2, 9, 129), torch.randn(2, 129, 8)
    assert exact_gemv.bmm(a, b, 20, 20, 1, per_row_b=False, any_rows=True) is None
    assert exact_gemv.bmm(a[..., :32], b[:, :32], 20, 20, 1, per_row_b=False) is None
    a[1, 3, 0] = float("nan")  # before the line's last element: the NaN must stick in its max
    for per_row_b in (False, True):  # the torch path decides what a NaN gives
        assert exact_gemv.bmm(a[..., :32], b[:, :32], 20, 20, 1, per_row_b=per_row_b, any_rows=True) is None


def _check_attention_products(source: torch.dtype, shapes, any_rows: bool = False) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(4)
    for batch, m, k, n in shapes:
        a = (torch.randn(batch, m, k, generator=g) * torch.logspace(-5, 5, k)).to(source).float()
        b = (torch.randn(batch, k, n, generator=g) * torch.logspace(-3, 3, n)).to(source).float()
        bits_a, bits_b, slices = exact_gemm.contraction_bits(source, source, k)
        qb, scale_b = exact_gemm.quantize(b, -2, bits_b)
        want = exact_gemm.exact_matmul(a, qb, scale_b, bits_a, slices)
        got = exact_gemv.bmm(a, b, bits_a, bits_b, slices, per_row_b=False, any_rows=any_rows)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (batch, m, k, n)
        p = torch.softmax(a.clamp(-50, 50), -1)
        p[..., ::3] = 0.0  # masked keys
        p[0, 0] = 0.0
        bits_p, bits_v, slices_p = exact_gemm.contraction_bits(torch.float32, source, k)
        qv, v_scale = exact_gemm.quantize(b, -1, bits_v)
        one = torch.ones((), dtype=torch.float64)
        want = exact_gemm.exact_matmul(p.double() * v_scale.transpose(-1, -2), qv, one, bits_p, slices_p)
        got = exact_gemv.bmm(p, b, bits_p, bits_v, slices_p, per_row_b=True, any_rows=any_rows)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (batch, m, k, n)
        assert torch.equal(exact_gemm.pv_product(p, b, source), got)


@pytest.mark.parametrize("x_dtype,w_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_compiled_row_quantization_and_scaling_back_have_the_torch_paths_bits(
    x_dtype: torch.dtype, w_dtype: torch.dtype
) -> None:
    """More rows than the GEMV takes: x quantized and the products scaled back compiled, around the
    library's fp64 GEMM of the cached integer weight (exact_gemv.linear_rows), against exact_matmul."""
    for (k, shards, n), m in itertools.product(SHAPES, (5, 17, 64)):
        x, w = _operands(m, k, n, x_dtype, w_dtype, seed=k * 5 + m)
        qb, scale, bits_a, slices = exact_gemm.quantized_weight(w, shards, x.dtype)
        got = exact_gemv.linear_rows(x, qb, scale, shards, bits_a, slices)
        want = _torch_path(x, w, shards)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (k, shards, n, m)
        assert torch.equal(exact_gemm.linear_partials(x, w, shards).view(torch.int32), want.view(torch.int32))
    x[2, 0] = float("nan")  # the torch path decides what a NaN gives
    assert exact_gemv.linear_rows(x, qb, scale, shards, bits_a, slices) is None


def test_compiled_tree_sum_has_the_torch_trees_bits() -> None:
    from tonpolicy.kernels.invariant import linear as invariant_linear

    g = torch.Generator().manual_seed(5)
    for c in (2, 3, 4, 5, 8):
        parts = torch.randn(c, 3, 257, generator=g) * torch.logspace(-8, 8, 257)
        got = exact_gemv.tree_sum(parts)
        want = invariant_linear._tree(parts, False)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), c
        assert torch.equal(invariant_linear.tree_sum(parts, torch.bfloat16), want.to(torch.bfloat16))
