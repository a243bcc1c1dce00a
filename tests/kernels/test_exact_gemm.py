"""The contract GEMM (tonpolicy.kernels.invariant.exact_gemm): exact by construction, so a row's bits depend on
that row and the weight alone. Checked against int64 arithmetic of the same integers (the definition),
for any row count, position, thread count, column shard and operand layout; its accuracy; and p @ v's
masked keys. Negative control: the library's own GEMM on the same operands depends on the row count."""

from __future__ import annotations

import pytest
import torch
from support.kernel_utils import DTYPES, num_threads, randn

from tonpolicy.kernels.invariant import exact_gemm as eg

SHAPES = [(128, 256), (384, 128), (1024, 1024), (3072, 1024), (32, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_result_is_the_definition(dtype: torch.dtype) -> None:
    """The fp64 library GEMM of the integer slices equals int64 arithmetic, and the output is the defined
    combination of those exact integers (one fp64 addition, exact scalings, one rounding)."""
    for k, n in SHAPES:
        x, w = randn(9, k, dtype=dtype, seed=k), randn(n, k, dtype=dtype, seed=n, std=k**-0.5)
        bits_a, bits_b, slices = eg.contraction_bits(dtype, dtype, k)
        assert bits_a + bits_b + (k - 1).bit_length() <= 53
        assert slices == (1 if dtype == torch.bfloat16 or bits_a >= 23 else 2)
        qx, scale_x = eg.quantize(x, -1, bits_a, slices)
        qw, scale_w = eg.quantize(w.t(), -2, bits_b)
        assert qx.abs().max() <= 2**bits_a and qw.abs().max() <= 2**bits_b
        parts = [(q.long() @ qw.long()).double() for q in (qx.unbind(-3) if slices == 2 else [qx])]
        for q, exact in zip(qx.unbind(-3) if slices == 2 else [qx], parts, strict=True):
            assert torch.equal(torch.matmul(q, qw), exact)  # exact, whatever MKL's order
        c = parts[0] if slices == 1 else parts[0] + parts[1] * 2.0**-bits_a
        expected = (c * scale_x * scale_w).float()
        assert torch.equal(eg.linear_partials(x, w, 1)[0], expected), (k, n)


def test_bound_holds_at_the_worst_case() -> None:
    """Every integer at its largest magnitude, one sign: the sum reaches the 2^53 bound and stays exact."""
    for k in (1, 2, 31, 32, 128, 1000, 4096, 8192, 25600):
        for dt in DTYPES:
            bits_a, bits_b, _ = eg.contraction_bits(dt, dt, k)
            assert bits_a + bits_b + (k - 1).bit_length() <= 53
            a = torch.full((2, k), float(2**bits_a), dtype=torch.float64)
            b = torch.full((k, 3), float(2**bits_b), dtype=torch.float64)
            assert torch.equal(a @ b, (a.long() @ b.long()).double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_rows_any_threads_any_columns(dtype: torch.dtype) -> None:
    for k, n in SHAPES:
        x, w = randn(300, k, dtype=dtype, seed=1 + k), randn(n, k, dtype=dtype, seed=2 + n, std=k**-0.5)
        full = eg.linear_partials(x, w, 1)
        for off, m in ((0, 1), (1, 2), (144, 2), (7, 3), (200, 5), (5, 64), (0, 300)):
            assert torch.equal(eg.linear_partials(x[off : off + m], w, 1), full[:, off : off + m]), (k, n, off, m)
        with num_threads(1):
            assert torch.equal(eg.linear_partials(x, w, 1), full)
        assert torch.equal(eg.linear_partials(x, w[: n // 2 + 3], 1), full[..., : n // 2 + 3])
        assert torch.equal(eg.linear_partials(x.t().contiguous().t(), w.t().contiguous().t(), 1), full)


def test_accuracy() -> None:
    """bf16 operands: the correctly rounded fp32 of the exact product (elements near their row's max are
    whole); fp32 operands: within fp32 rounding of the fp64 product."""
    x, w = randn(16, 1024, dtype=torch.bfloat16, seed=3), randn(512, 1024, dtype=torch.bfloat16, seed=4, std=1 / 32)
    exact = x.double() @ w.double().t()
    got = eg.linear_partials(x, w, 1)[0].double()
    assert ((got - exact).abs() <= exact.abs() * 2**-23 + 1e-6).all()
    x32, w32 = x.float() + randn(16, 1024, seed=5) * 1e-3, w.float()
    exact32 = x32.double() @ w32.double().t()
    err = (eg.linear_partials(x32, w32, 1)[0].double() - exact32).abs().max()
    assert err < 1e-5 * exact32.abs().max()


def test_weight_cache_follows_in_place_updates() -> None:
    x, w = randn(4, 128), randn(64, 128, std=0.1)
    before = eg.linear_partials(x, w, 2)
    w.mul_(2.0)  # bumps the version: the cached quantisation is stale
    assert torch.equal(eg.linear_partials(x, w, 2), before * 2)


def test_pv_masked_keys_change_nothing() -> None:
    """p @ v with v's per-key scale folded into p: a key whose p is 0 (masked, or not yet decoded) adds
    exactly 0, whatever its value, so prefill (future keys present) equals decode (keys zero-padded)."""
    for vdt in DTYPES:
        p = torch.rand(3, 4, 32)
        p[..., 20:] = 0.0
        v = randn(3, 32, 16, dtype=vdt, seed=9)
        ref = eg.pv_product(p, v.float(), vdt)
        v2 = v.clone()
        v2[:, 20:] = 1e4  # huge future values
        assert torch.equal(eg.pv_product(p, v2.float(), vdt), ref)
        v2[:, 20:] = 0
        assert torch.equal(eg.pv_product(p, v2.float(), vdt), ref)
        assert torch.equal(eg.pv_product(p[:, :1], v.float(), vdt), ref[:, :1])


def test_library_gemm_depends_on_rows() -> None:
    """Negative control: the same operands through the library's fp32 GEMM give a row other bits in a
    1-row call than in a 300-row call, on some shape (the problem the construction removes)."""
    differs = 0
    for k, n in SHAPES:
        x, w = randn(300, k, seed=1 + k), randn(n, k, seed=2 + n, std=k**-0.5)
        differs += int(not torch.equal(x[:1] @ w.t(), (x @ w.t())[:1]))
    assert differs > 0
