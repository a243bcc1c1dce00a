"""The native library of contract v2's row-wise ops (ordered_rowwise.cpp): one per instruction-set path,
chosen as the ordered GEMM's (ordered_isa; its avx512bf16 runs the avx512 library), built into the kernel
cache (native_build), called through one entry with its arguments in two arrays."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from tonpolicy.kernels import native_build
from tonpolicy.kernels.invariant import ordered_isa
from tonpolicy.kernels.invariant.ordered_isa import BASE_FLAGS, PORTABLE, OrderedKernelsUnavailable

PATHS = ("avx512", "avx2")  # best first
PATH_FLAGS = {p: ordered_isa.PATH_FLAGS[p] for p in (*PATHS, PORTABLE)}
SOURCE_FILE = Path(__file__).with_name("ordered_rowwise.cpp")
ISA_IDS = {"avx512": 5, "avx2": 2, PORTABLE: 0}  # what rowwise_isa() answers

_OPS = {
    "exp": 0, "log": 1, "row_sum": 2, "row_max": 3, "rms_norm": 4, "swiglu": 5, "logprobs": 6, "rope": 7,
    "sincos": 8, "inv_freq": 9, "attn_softmax": 10, "attn_merge": 11,
}  # fmt: skip
_RC = {
    1: "unknown op",
    2: "unsupported dtype",
    3: "a token outside [0, vocab)",
    4: "a position outside [0, 2^24)",
    5: "head_dim must be even and >= 2",
}


def isa_paths() -> list[str]:
    """The paths this CPU runs, best first (the ordered GEMM's choice, its avx512bf16 as avx512)."""
    return [p for p in PATHS if p in {_lib_path(q) for q in ordered_isa.isa_paths()}]


def _lib_path(gemm_path: str) -> str:
    return "avx512" if gemm_path == "avx512bf16" else gemm_path


def chosen_path() -> str:
    """TONPOLICY_ORDERED_ISA if set (a path this CPU runs), else the best path: the ordered GEMM's rule."""
    return _lib_path(ordered_isa.chosen_path())


class RowwiseLibrary:
    """One path's compiled ops (ctypes): `call(op, ref, ints, floats)`, and the path it was built for (`isa`)."""

    def __init__(self, path: str, so: Path) -> None:
        lib = ctypes.CDLL(str(so))
        lib.rowwise_call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.rowwise_call.restype = ctypes.c_int
        lib.rowwise_isa.restype = ctypes.c_int
        self.path, self.so, self.call, self.isa = path, so, lib.rowwise_call, lib.rowwise_isa()


_libs: dict[str, RowwiseLibrary | OrderedKernelsUnavailable] = {}  # a path's library or its remembered failure
_args = threading.local()


def _arrays() -> tuple[ctypes.Array, ctypes.Array]:
    a = getattr(_args, "a", None)
    if a is None:
        a = _args.a = ((ctypes.c_int64 * 12)(), (ctypes.c_double * 2)())
    return a


# The test-only portable build runs on any x86-64; the real paths only where the CPU has their flags.
_LIBRARIES = native_build.PathLibraries(
    "ordered_rowwise",
    SOURCE_FILE,
    {path: [*BASE_FLAGS, *flags, f"-DROWWISE_ISA_{path.upper()}"] for path, flags in PATH_FLAGS.items()},
    RowwiseLibrary,
    lambda p: p == PORTABLE or p in isa_paths(),
    OrderedKernelsUnavailable,
    "the ordered row-wise ops",
)


def build_paths(paths: list[str]) -> None:
    """Build several paths at once (the compilers run outside the GIL); errors are raised by library()."""
    _LIBRARIES.build_paths(paths)


def library(path: str | None = None) -> RowwiseLibrary:
    """The compiled ops of `path` (default: the chosen path), built on first use."""
    return _LIBRARIES.library(path or chosen_path(), _libs)


def require() -> None:
    """Raise OrderedKernelsUnavailable (saying what is missing) unless the chosen path builds and loads."""
    library()


def run(lib: RowwiseLibrary, op: str, ref: bool, ints: tuple[int, ...], floats: tuple[float, ...] = ()) -> None:
    """Run `op` (its scalar reference if `ref`) with its integer and float arguments; ValueError if refused."""
    a, d = _arrays()
    a[: len(ints)] = ints
    if floats:
        d[: len(floats)] = floats
    rc = lib.call(_OPS[op], int(ref), a, d)
    if rc:
        raise ValueError(f"ordered_rowwise.{op}: {_RC.get(rc, f'code {rc}')}")
