"""Contract v2's GEMM ("owned order"): each output element is an fp32 FMA chain in an order this project
writes down, so its bits depend only on IEEE arithmetic: not on the batch, the row's position, the tile,
the thread count, the library or the CPU.

The definition (`describe()` states it for the contract's fingerprint). C = A @ B, A [M, K], B given as a
weight W [N, K]: C[m, n] is
- the fp32 chain (whenever an operand is not bf16): operands converted to fp32 exactly; c = +0.0f; for
  k = 0, 1, ..., K-1: c = fma(a[k], w[k], c);
- the bf16 pair chain (A and W both bf16): K padded at the end with zeros to even; c = +0.0f; for pairs
  i = 0, 1, ..., K/2-1: c = fma(a[2i+1], w[2i+1], c), then c = fma(a[2i], w[2i], c) (the odd element
  first: the semantics of the AVX512_BF16 instruction vdpbf16ps);
- in both, every FMA rounds to nearest even with DAZ and FTZ: a subnormal input reads as zero of its
  sign; a result that is tiny (below 2^-126 in magnitude after rounding to fp32's 24 bits with an
  unbounded exponent, as x86's FTZ decides) is zero of its sign. NaN and inf as IEEE says (which NaN is
  not defined: only "is NaN");
- the result is fp32 (the caller rounds it to the activation dtype).
K-shards: partial C[c] is the chain over k in [c*K/C, (c+1)*K/C) alone (each from +0; the pair chain
needs K/C even when C > 1). `bmm` is the fp32 chain for attention's products.

ordered_gemm.cpp implements it once per instruction-set path (avx512bf16: vdpbf16ps; avx512 and avx2: the
pair chain as two FMAs, odd first, flushed by MXCSR FTZ|DAZ), vectorised across output columns only, K
never split; each path's library is built with fixed -m flags (never -march=native) into the kernel cache
(tonpolicy.kernels.native_build). The path (ordered_isa) is the best this CPU runs, or TONPOLICY_ORDERED_ISA.
A scalar reference (plain loops, std::fma, flushes by hand) is in every library for the tests, and two
`portable` builds (the AVX-512 paths' 16-lane code on plain C++ lanes) let any x86-64 run those paths' logic.
`python -m tonpolicy.kernels.invariant.ordered_gemm --build` builds every path this CPU runs.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from tonpolicy.kernels import native_build
from tonpolicy.kernels.invariant.exact_gemm import _TextbookGrad

# The ISA choice and the packed weights, imported from here by their callers too.
from tonpolicy.kernels.invariant.ordered_isa import BASE_FLAGS as BASE_FLAGS
from tonpolicy.kernels.invariant.ordered_isa import ISA_ENV as ISA_ENV
from tonpolicy.kernels.invariant.ordered_isa import PATH_FLAGS as PATH_FLAGS
from tonpolicy.kernels.invariant.ordered_isa import PATHS as PATHS
from tonpolicy.kernels.invariant.ordered_isa import PORTABLE as PORTABLE
from tonpolicy.kernels.invariant.ordered_isa import PORTABLE_DP as PORTABLE_DP
from tonpolicy.kernels.invariant.ordered_isa import V1_STILL_RUNS, chosen_path, isa_paths
from tonpolicy.kernels.invariant.ordered_isa import OrderedKernelsUnavailable as OrderedKernelsUnavailable
from tonpolicy.kernels.invariant.ordered_pack import packed_weight
from tonpolicy.kernels.native_build import cpu_flags as cpu_flags

SOURCE_FILE = Path(__file__).with_suffix(".cpp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Lib:
    """One path's compiled functions (ctypes). The products take their arguments in one int64 array (ctypes
    converts each argument of a call: one is far cheaper than eleven): one array per calling thread."""

    def __init__(self, path: str, so: Path) -> None:
        lib = ctypes.CDLL(str(so))
        i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.ordered_linear_v.argtypes = lib.ordered_bmm_v.argtypes = [vp]
        lib.ordered_reference.argtypes = [vp, i32, i64, i64, i64, vp, i32, i64, i64, vp]
        lib.ordered_bmm_reference.argtypes = [vp, i32, vp, i32, i64, i64, i64, i64, vp]
        for f in (lib.ordered_linear_v, lib.ordered_bmm_v, lib.ordered_reference, lib.ordered_bmm_reference):
            f.restype = i32
        lib.ordered_isa.restype = i32
        self.path, self.so, self.lib = path, so, lib
        self.linear_v, self.bmm_v = lib.ordered_linear_v, lib.ordered_bmm_v
        self.reference, self.bmm_reference = lib.ordered_reference, lib.ordered_bmm_reference


_args = threading.local()


def _arg_array() -> ctypes.Array:
    a = getattr(_args, "a", None)
    if a is None:
        a = _args.a = (ctypes.c_int64 * 12)()
    return a


_libs: dict[str, _Lib | OrderedKernelsUnavailable] = {}  # a path's library or its remembered failure
# The portable builds run on any x86-64; the real paths only where the CPU has their flags.
_LIBRARIES = native_build.PathLibraries(
    "ordered_gemm",
    SOURCE_FILE,
    {path: [*BASE_FLAGS, *flags] for path, flags in PATH_FLAGS.items()},
    _Lib,
    lambda p: p not in PATHS or p in isa_paths(),
    OrderedKernelsUnavailable,
    "the ordered GEMM (contract v2)",
    f"; {V1_STILL_RUNS}",
)


def build_paths(paths: list[str]) -> None:
    """Build several paths at once (the compiler runs outside the GIL); errors are raised by library()."""
    _LIBRARIES.build_paths(paths)


def library(path: str | None = None) -> _Lib:
    """The compiled functions of `path` (default: the chosen path), built on first use."""
    return _LIBRARIES.library(path or chosen_path(), _libs)


def require() -> None:
    """Raise OrderedKernelsUnavailable (saying what is missing) unless the chosen path builds and loads."""
    library()


def build_all() -> list[str]:
    """Build every path this CPU runs (for the setup script); the paths built."""
    paths = isa_paths()
    build_paths(paths)
    for p in paths:
        library(p)
    return paths


# ---------------------------------------------------------------------------------------------------
def _check(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> None:
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"the ordered GEMM runs on CPU tensors (got {x.device} and {w.device})")
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES:
        raise ValueError(f"the ordered GEMM takes bf16 or fp32 operands (got {x.dtype} and {w.dtype})")
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w.shape)}: need x [..., K] and w [N, K]")
    if num_shards < 1 or w.shape[1] % num_shards:
        raise ValueError(f"K={w.shape[1]} does not divide into {num_shards} shards")


def _quick_check(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> None:
    """_check's conditions, cheaply when they hold (a decode step calls this ~200 times)."""
    if not (
        x.dtype in _DTYPES and w.dtype in _DTYPES and x.is_cpu and w.is_cpu and w.dim() == 2 and x.dim() > 0
        and x.shape[-1] == w.shape[1] and num_shards >= 1 and w.shape[1] % num_shards == 0
    ):  # fmt: skip
        _check(x, w, num_shards)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def _rc_message(rc: int, k: int, num_shards: int) -> str:
    if rc == 1:
        return f"the bf16 pair chain needs an even shard length: K={k} in {num_shards} shards"
    return f"the ordered GEMM refused its arguments (code {rc})"


def _linear_into(lib: _Lib, x: torch.Tensor, w: torch.Tensor, num_shards: int, out: torch.Tensor) -> torch.Tensor:
    """out [C, M, N] (any view of it) <- the chains of x [..., K] against w [N, K] (checked by the caller)."""
    n, k = w.shape
    if x.is_contiguous():
        m = x.numel() // k if k else math.prod(x.shape[:-1])
        lda = k
    else:
        x = _rows(x)
        m = x.shape[0]
        lda = x.stride(0) if m > 1 else k
    if m == 0 or n == 0:
        return out
    wp = packed_weight(w, num_shards)
    a = _arg_array()
    a[:11] = (
        x.data_ptr(), _DTYPES[x.dtype], m, k, lda, wp.data_ptr(), _DTYPES[w.dtype], n, num_shards, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    rc = lib.linear_v(a)
    if rc:
        raise ValueError(_rc_message(rc, k, num_shards))
    return out


def _partials(lib: _Lib, x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
    out = torch.empty((num_shards, *x.shape[:-1], w.shape[0]), dtype=torch.float32)
    return _linear_into(lib, x, w, num_shards, out)


def _linear(lib: _Lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
    return _linear_into(lib, x, w, 1, out)


def _bmm_check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError(f"the ordered bmm runs on CPU tensors (got {a.device} and {b.device})")
    if a.dtype not in _DTYPES or b.dtype not in _DTYPES:
        raise ValueError(f"the ordered bmm takes bf16 or fp32 operands (got {a.dtype} and {b.dtype})")
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)}: need a [..., M, K] and b [..., K, N]")


def _bmm(lib: _Lib, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ad, bd = _DTYPES.get(a.dtype), _DTYPES.get(b.dtype)
    sa, sb = a.shape, b.shape
    if ad is None or bd is None or not (a.is_cpu and b.is_cpu) or len(sa) < 2 or len(sb) < 2 or sa[-1] != sb[-2]:
        _bmm_check(a, b)
    if sa[:-2] != sb[:-2]:
        lead = torch.broadcast_shapes(sa[:-2], sb[:-2])
        a, b = a.expand(*lead, *sa[-2:]), b.expand(*lead, *sb[-2:])
        sa = a.shape
    m, k, n = sa[-2], sa[-1], sb[-1]
    if torch.get_default_dtype() is torch.float32:  # ~1 us less than the general form
        out = torch.empty(*sa[:-1], n)
    else:
        out = torch.empty((*sa[:-1], n), dtype=torch.float32)
    if m == 0 or n == 0 or out.numel() == 0:
        return out
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.is_contiguous():
        b = b.contiguous()
    v = _arg_array()
    batch = out.numel() // (m * n)
    v[:10] = (a.data_ptr(), ad, b.data_ptr(), bd, batch, m, k, n, out.data_ptr(), torch.get_num_threads())
    rc = lib.bmm_v(v)
    if rc:
        raise ValueError(f"the ordered bmm refused its arguments (code {rc})")
    return out


class OrderedFunctions:
    """The ordered products on one path's library (the module's functions use the chosen path; tests
    take each path with `functions(path)`)."""

    def __init__(self, path: str | None = None) -> None:
        self.lib = library(path)
        self.path = self.lib.path

    def linear_partials(self, x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
        """fp32 [C, *lead, N]: x [..., K] against w [N, K] per canonical K-shard (each its own chain)."""
        _quick_check(x, w, num_shards)
        if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
            # the ordered forward, the plain product's gradient (per shard)
            n, k = w.shape
            ks = k // num_shards
            x3 = x.reshape(-1, num_shards, ks).transpose(0, 1)  # [C, M, Ks]
            w3 = w.reshape(n, num_shards, ks).permute(1, 2, 0)  # [C, Ks, N]
            m = x3.shape[1]

            def fwd(_a: torch.Tensor, _b: torch.Tensor) -> torch.Tensor:
                return _partials(self.lib, x.detach(), w.detach(), num_shards).view(num_shards, m, n)

            return _TextbookGrad.apply(x3, w3, fwd).view(num_shards, *x.shape[:-1], n)
        return _partials(self.lib, x, w, num_shards)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """fp32 [*lead, N] = linear_partials(x, w, 1)[0] (no copy)."""
        _quick_check(x, w, 1)
        if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
            return _TextbookGrad.apply(x, w.t(), lambda _a, _b: _linear(self.lib, x.detach(), w.detach()))
        if x.dim() == 2 and torch.get_default_dtype() is torch.float32:  # ~1 us less than the general form
            out = torch.empty(x.shape[0], w.shape[0])
        else:
            out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
        return _linear_into(self.lib, x, w, 1, out)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """fp32 [..., M, N] = a [..., M, K] @ b [..., K, N], the fp32 chain over k ascending."""
        if (a.requires_grad or b.requires_grad) and torch.is_grad_enabled():
            return _TextbookGrad.apply(a, b, lambda x, y: _bmm(self.lib, x, y))
        return _bmm(self.lib, a, b)

    def reference_linear_partials(self, x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
        """The scalar reference of linear_partials (slow: tests only)."""
        _check(x, w, num_shards)
        x2, w = _rows(x.detach()), w.detach().contiguous()
        m, k = x2.shape
        n = w.shape[0]
        out = torch.empty(num_shards, *x.shape[:-1], n, dtype=torch.float32)
        if out.numel():
            lda = x2.stride(0) if m > 1 else k
            rc = self.lib.reference(
                x2.data_ptr(), _DTYPES[x2.dtype], m, k, lda, w.data_ptr(), _DTYPES[w.dtype], n, num_shards,
                out.data_ptr(),
            )  # fmt: skip
            if rc:
                raise ValueError(_rc_message(rc, k, num_shards))
        return out

    def reference_bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The scalar reference of bmm (tests only)."""
        if a.shape[:-2] != b.shape[:-2]:
            lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
        a, b = a.detach().contiguous(), b.detach().contiguous()
        *lead, m, k = a.shape
        n = b.shape[-1]
        out = torch.empty(*lead, m, n, dtype=torch.float32)
        if out.numel():
            batch = out.numel() // (m * n)
            rc = self.lib.bmm_reference(
                a.data_ptr(), _DTYPES[a.dtype], b.data_ptr(), _DTYPES[b.dtype], batch, m, k, n, out.data_ptr()
            )
            if rc:
                raise ValueError(f"the ordered bmm refused its arguments (code {rc})")
        return out


_functions: dict[str | None, OrderedFunctions] = {}


def functions(path: str | None = None) -> OrderedFunctions:
    """The ordered products on `path` (default: the chosen path)."""
    got = _functions.get(path)
    if got is None:
        got = _functions[path] = OrderedFunctions(path)
    return got


def linear_partials(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
    """fp32 [C, *lead, N]: x [..., K] (bf16/fp32) against w [N, K] (bf16/fp32) per canonical K-shard."""
    return functions().linear_partials(x, w, num_shards)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 [*lead, N] = x @ w.T as ordered chains (K whole)."""
    return functions().linear(x, w)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [..., M, N] = a [..., M, K] @ b [..., K, N] (bf16/fp32, upcast exactly): the fp32 chain."""
    return functions().bmm(a, b)


def reference_linear_partials(x: torch.Tensor, w: torch.Tensor, num_shards: int) -> torch.Tensor:
    return functions().reference_linear_partials(x, w, num_shards)


def reference_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return functions().reference_bmm(a, b)


def describe() -> dict[str, Any]:
    """The definition in words (part of the contract's fingerprint: nothing about the path or host)."""
    return {
        "element": "C[m,n] of C = A @ W^T (A [M,K], W [N,K]) is one fp32 FMA chain; lanes and threads split "
        "rows and columns, never the chain",
        "fp32_chain": "when either operand is not bf16: operands converted to fp32 exactly; c = +0.0f; for k = "
        "0..K-1 ascending: c = fma(a[k], w[k], c)",
        "bf16_pair_chain": "when both operands are bf16: K zero-padded at the end to even; c = +0.0f; for pairs "
        "i = 0..K/2-1 ascending: c = fma(a[2i+1], w[2i+1], c) then c = fma(a[2i], w[2i], c) (odd element first)",
        "fma": "single rounding to nearest even; DAZ: a subnormal input reads as zero of its sign; FTZ: a result "
        "whose magnitude, rounded to 24 bits with an unbounded exponent, is below 2^-126 becomes zero of its "
        "sign; NaN/inf as IEEE 754 (a NaN's payload and sign are not defined)",
        "k_shards": "partial C[c] is the chain over k in [c*K/C, (c+1)*K/C) alone, from +0 (pair chain: K/C even "
        "when C > 1)",
        "bmm": "C = A @ B (B [K,N]): the fp32 chain over k ascending, operands upcast exactly",
        "result": "fp32; any rounding to the activation dtype is the caller's",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tonpolicy.kernels.invariant.ordered_gemm")
    ap.add_argument("--build", action="store_true", help="build every instruction-set path this CPU runs")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0
    try:
        paths = build_all()
        if not paths:
            chosen_path()  # raises, saying why
        for p in paths:
            print(f"ordered_gemm {p}: {library(p).so}")
        print(f"ordered_gemm: chosen path {chosen_path()}")
    except OrderedKernelsUnavailable as e:
        print(f"ordered_gemm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
