"""Triton's interpreter (TRITON_INTERPRET=1: the `triton` kernel set on a CPU, for tests) with `tl.dot` as a
fixed-order tile GEMM, the property a GPU's compiled dot has and the set's invariances rest on.

The interpreter computes `tl.dot` with NumPy's BLAS, whose kernels on some hosts give a row bits that
depend on its position in the tile (measured: OpenBLAS 0.3.30 under OPENBLAS_CORETYPE=Haswell, which
this workplace sets on AMD EPYC hosts; rows at another offset of a [128, 64] x [64, 128] tile differed in
the last bit). So fp32/fp16 dots go through torch's GEMM instead (fp16 upcast exactly, fp32 products and
sums, as the interpreter's own `dtype=float32` does), whose rows do not depend on their position
(tests/kernels/test_kernels_linear.py). e4m3 dots (fp8_block) take the same path, their values decoded
exactly to fp32 (the interpreter's own path would convert them to fp16, exactly, and call NumPy's BLAS):
exact products, fp32 sums in torch's GEMM order. Compiled kernels (a GPU) are untouched.
"""

from __future__ import annotations

import os

import torch


def use_torch_dot() -> None:
    """Route the interpreter's fp32/fp16 `tl.dot` through torch's GEMM (idempotent; a no-op unless
    TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "torch_dot", False):
        return
    original = builder.create_dot

    def fp8(t) -> bool:  # noqa: ANN001 - an interpreter TensorHandle (e4m3 values stored as their bytes)
        return t.dtype.scalar == tl.float8e4nv

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        if fp8(a) and fp8(b) and d.data.dtype == np.float32:
            at, bt = (torch.from_numpy(np.ascontiguousarray(t.data)).view(torch.float8_e4m3fn).float() for t in (a, b))
            return interpreter.TensorHandle(torch.matmul(at, bt).numpy() + d.data, d.dtype.scalar)
        if not (
            a.data.dtype == b.data.dtype and a.data.dtype in (np.float32, np.float16) and d.data.dtype == np.float32
        ):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        at, bt = (torch.from_numpy(np.ascontiguousarray(t.data)).float() for t in (a, b))
        return interpreter.TensorHandle(torch.matmul(at, bt).numpy() + d.data, d.dtype.scalar)

    create_dot.torch_dot = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
