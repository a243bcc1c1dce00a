from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests must not reach W&B's servers.
os.environ.setdefault("WANDB_MODE", "offline")
# Without a GPU the `triton` kernel set runs in Triton's interpreter (set before Triton is imported:
# `triton.jit` reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_dot_by_torch() -> None:
    """The interpreter's `tl.dot` stands in for a GPU's fixed-order tile GEMM. It computes it with NumPy's
    BLAS, whose kernels on some hosts give a row bits that depend on its position in the tile (measured:
    OpenBLAS 0.3.30 with OPENBLAS_CORETYPE=Haswell, which this workplace sets on AMD EPYC hosts), so the
    triton set's row invariance would be tested against the host BLAS, not the kernels' structure. Here
    fp32/fp16 dots go through torch's GEMM (fp16 upcast exactly, fp32 products and sums, as the
    interpreter's own `dtype=float32`), whose rows do not depend on their position (tests/test_kernels_linear.py)."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:  # no Triton: nothing to interpret
        return
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        ok = a.data.dtype == b.data.dtype and a.data.dtype in (np.float32, np.float16) and d.data.dtype == np.float32
        if not ok:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        at, bt = (torch.from_numpy(np.ascontiguousarray(t.data)).float() for t in (a, b))
        return interpreter.TensorHandle(torch.matmul(at, bt).numpy() + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_dot_by_torch()

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
