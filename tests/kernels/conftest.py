"""Every invariance test of this folder that takes `kernel_set` runs on contract v2's kernel set. v1's
(`invariant`, kept for comparison) keeps its own GEMM tests (test_exact_gemm.py, test_exact_gemv.py) and
the cross-rank row-parallel case (test_kernels_linear.py), so the suite stays within CI's time."""

from __future__ import annotations

import pytest

KERNEL_SETS = ("ordered",)


@pytest.fixture(params=KERNEL_SETS)
def kernel_set(request: pytest.FixtureRequest) -> str:
    return request.param
