"""The contract GEMM for 1-4 rows (one stream of decode) as a compiled GEMV that reads the weight in its
own dtype (bf16 or fp32), not the fp64 integer copy exact_gemm keeps: 4x less memory traffic for a bf16
weight, and one call in place of the ~10 torch ops of quantize + matmul + scale.

Its bits equal exact_gemm's by construction, not by measurement:
- the same quantization: A per row (over the shard's K) and B per column, powers of two from frexp of
  the line's max, rounding half to even (`(v + 1.5*2^52) - 1.5*2^52`, exact for |v| < 2^51), A's second
  slice from the exact remainder;
- every product and partial sum is an integer below 2^53 in fp64, so the SIMD order of the sum (and
  FMA) cannot change a bit;
- the same scaling back: (hi + lo * 2^-bits_a) * scale_a * scale_b, each step one IEEE fp64 op, then
  one rounding to fp32.
tests/kernels/test_exact_gemv.py checks bit equality against exact_gemm on many shapes and dtypes.

exact_gemv.cpp is compiled once per (source, compiler, flags, CPU flags) with g++ into
TONPOLICY_KERNEL_CACHE (default ~/.cache/tonpolicy/kernels; ~1 s; tonpolicy.kernels.native_build) and loaded
with ctypes. Without g++, or with TONPOLICY_EXACT_GEMV=0, `linear_partials` returns None and exact_gemm's
torch path runs: the same bits.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import warnings
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tonpolicy.kernels import native_build, weight_cache
from tonpolicy.kernels.invariant.exact_bits import contraction_bits, pow2

MAX_ROWS = 4  # rows x slices accumulators live in registers: up to 8
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# -march=native: the build is keyed by the CPU's flags. No -ffast-math: the rounding (v + 1.5*2^52) - 1.5*2^52
# must stay as written.
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-Wno-psabi", "-fPIC", "-shared"]

SOURCE_FILE = Path(__file__).with_suffix(".cpp")

_lib: list = []  # [ctypes function or None], filled once
_lock = threading.Lock()


def library_path() -> Path | None:
    """The compiled kernel for this source, compiler and CPU (built on first use), or None."""
    cpu = native_build.cpu_flags_line() or platform.processor()  # -march=native: the CPU is part of the key
    try:
        return native_build.build("exact_gemv", SOURCE_FILE, FLAGS, extra_key=[cpu, platform.machine()])
    except native_build.NoCompilerError:
        return None
    except native_build.NativeBuildError as e:
        warnings.warn(f"exact_gemv: the build failed, the torch path runs (same bits):\n{e}", stacklevel=2)
        return None


def kernel():  # noqa: ANN201
    """The compiled library (ctypes), or None (no compiler, a failed build, or TONPOLICY_EXACT_GEMV=0)."""
    if not _lib:
        with _lock:
            if not _lib:
                lib = None
                path = library_path() if os.environ.get("TONPOLICY_EXACT_GEMV", "1") != "0" else None
                if path is not None:
                    lib = ctypes.CDLL(str(path))
                    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
                    lib.exact_gemv.argtypes = [vp, i32, vp, i32, i64, i64, i64, i64, i32, i32, vp, vp, vp, i32]
                    lib.exact_bmm.argtypes = [vp, vp, i64, i64, i64, i64, i32, i32, i32, i32, vp, i32]
                    lib.exact_gemv.restype = lib.exact_bmm.restype = i32
                    lib.tree_sum_f32.argtypes = [vp, i64, i64, vp]
                    lib.tree_sum_f32.restype = None
                    lib.quantize_rows.argtypes = [vp, i32, i64, i64, i64, i32, i32, vp, vp]
                    lib.quantize_rows.restype = i32
                    lib.scale_back.argtypes = [vp, i64, i64, i64, i32, i32, vp, vp, vp]
                    lib.scale_back.restype = None
                _lib.append(lib)
    return _lib[0]


# Per weight: its per-(shard, column) powers of two, 2^(bits_b - e) and 2^(e - bits_b), [C, N] fp64.
_scales = WeakIdKeyDictionary()


def column_scales(w: torch.Tensor, num_shards: int, bits_b: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (weight_cache.generation(), w.data_ptr(), w._version, tuple(w.shape), w.dtype, num_shards, bits_b)
    hit = _scales.get(w)
    if hit is not None and hit[0] == key:
        return hit[1]
    n, k = w.shape
    amax = w.detach().reshape(n, num_shards, k // num_shards).abs().amax(-1).t().to(torch.float64)  # exact
    _, e = torch.frexp(amax)
    scales = (pow2(bits_b - e).contiguous(), pow2(e - bits_b).contiguous())
    try:
        _scales[w] = (key, scales)
    except TypeError:
        pass
    return scales


def linear_partials(x2: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor | None:
    """fp32 [C, M, N] partials of x2 [M, K] @ w[N, K].T over C canonical K-shards, the bits of
    exact_gemm.linear_partials; None where this path does not apply (the caller runs exact_gemm's)."""
    m, k = x2.shape
    if not 1 <= m <= MAX_ROWS or x2.dtype not in _DTYPES or w.dtype not in _DTYPES or x2.device.type != "cpu":
        return None
    lib = kernel()
    if lib is None or not w.is_contiguous():
        return None
    n = w.shape[0]
    bits_a, bits_b, slices = contraction_bits(x2.dtype, w.dtype, k // num_shards)
    su, sd = column_scales(w, num_shards, bits_b)
    x2 = x2.contiguous()
    out = torch.empty(num_shards, m, n, dtype=torch.float32)
    rc = lib.exact_gemv(
        x2.data_ptr(), _DTYPES[x2.dtype], w.data_ptr(), _DTYPES[w.dtype], m, k, n, num_shards, bits_a, slices,
        su.data_ptr(), sd.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None


def linear_rows(
    x2: torch.Tensor, qb: torch.Tensor, scale_b: torch.Tensor, num_shards: int, bits_a: int, slices: int
) -> torch.Tensor | None:
    """exact_gemm.exact_matmul for x2 [M, K] (bf16 or fp32) cut into `num_shards` K-shards against the
    cached integer weight qb [C, K/C, N] and its column scales [C, 1, N]: x's quantization and the scaling
    back compiled (one call each, where the torch path runs ~12 ops), the fp64 GEMM the library's. The same
    bits: the same quantization, exact integer sums in any order, the same IEEE ops scaling back. None
    where this path does not apply (the caller runs exact_matmul)."""
    m, k = x2.shape
    if x2.dtype not in _DTYPES or x2.device.type != "cpu" or m == 0 or k == 0:
        return None
    lib = kernel()
    if lib is None:
        return None
    x2, ks, n = x2.contiguous(), k // num_shards, qb.shape[-1]
    qa = torch.empty(num_shards, slices * m, ks, dtype=torch.float64)
    sa = torch.empty(num_shards, m, dtype=torch.float64)
    xdt = _DTYPES[x2.dtype]
    if lib.quantize_rows(x2.data_ptr(), xdt, m, k, num_shards, bits_a, slices, qa.data_ptr(), sa.data_ptr()):
        return None  # a NaN or inf: the torch path decides what it gives
    prod = torch.matmul(qa, qb)
    sb = scale_b.reshape(num_shards, n).contiguous()
    out = torch.empty(num_shards, m, n, dtype=torch.float32)
    lib.scale_back(prod.data_ptr(), num_shards, m, n, slices, bits_a, sa.data_ptr(), sb.data_ptr(), out.data_ptr())
    return out


MAX_BMM_ROWS = 8  # rows x slices accumulators: up to 16
# With `any_rows` (the attention's products: scores over the head dim, p @ v over a key tile) more rows are
# taken 16 / slices at a time (the same bits: a row's result depends on that row and B alone) when the
# contraction is at most this long; a longer one (A's quantized rows out of L1) or a linear's (whose fp64
# GEMM on the cached integer weight is faster) is left to the library's GEMM.
CHUNKED_MAX_K = 128


def bmm(
    a: torch.Tensor, b: torch.Tensor, bits_a: int, bits_b: int, slices: int, per_row_b: bool, any_rows: bool = False
) -> torch.Tensor | None:
    """fp32 C = A @ B for fp32 A [..., M, K], B [..., K, N] (the same leading dims), with the bits of
    exact_gemm: `per_row_b` False as `matmul_as` (B per column), True as `pv_product` (B per row, its
    scale folded into A). None where this path does not apply (the caller runs exact_gemm's)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu" or b.device.type != "cpu":
        return None
    *lead, m, k = a.shape
    n = b.shape[-1]
    many = any_rows and k <= CHUNKED_MAX_K
    if m < 1 or (m > MAX_BMM_ROWS and not many) or b.shape[:-2] != a.shape[:-2] or b.shape[-2] != k:
        return None
    if k == 0 or n == 0:
        return None
    lib = kernel()
    if lib is None:
        return None
    a, b = a.contiguous(), b.contiguous()
    batch = a.numel() // (m * k)
    out = torch.empty(*lead, m, n, dtype=torch.float32)
    rc = lib.exact_bmm(
        a.data_ptr(), b.data_ptr(), batch, m, k, n, bits_a, bits_b, slices, int(per_row_b), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None


TREE_MAX = 1 << 16  # elements per shard a compiled tree sum takes (decode sizes; larger: torch's blocks)


def tree_sum(partials: torch.Tensor) -> torch.Tensor | None:
    """fp32 [...] = the pairwise fp32 tree over dim 0 of fp32 `partials`, as invariant_linear.tree_sum
    computes it (one IEEE fp32 add per node); None where this path does not apply."""
    if partials.dtype != torch.float32 or partials.device.type != "cpu" or partials.shape[0] < 2:
        return None
    length = partials[0].numel()
    lib = kernel()
    if lib is None or length > TREE_MAX:
        return None
    partials = partials.contiguous()
    out = torch.empty(partials.shape[1:], dtype=torch.float32)
    lib.tree_sum_f32(partials.data_ptr(), partials.shape[0], length, out.data_ptr())
    return out
