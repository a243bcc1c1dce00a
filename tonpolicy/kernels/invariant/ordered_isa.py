"""Which instruction-set path contract v2's native kernels (the ordered GEMM and row-wise ops) run: the
paths, the compiler flags each is built with, what each needs from the CPU, and the choice (the best this
CPU runs, or TONPOLICY_ORDERED_ISA). Every path computes the same bits: the choice is speed only."""

from __future__ import annotations

import os
import platform

from tonpolicy.kernels.native_build import cpu_flags

ISA_ENV = "TONPOLICY_ORDERED_ISA"
PATHS = ("avx512bf16", "avx512", "avx2")  # best first
# Tests only, on any x86-64: the AVX-512 paths' 16-lane code on plain C++ lanes (each FMA the reference's),
# the pair chain as the avx512 path emulates it, or (portable_dp) as the avx512bf16 path runs it.
PORTABLE = "portable"
PORTABLE_DP = "portable_dp"
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
PATH_FLAGS = {
    "avx512bf16": [*_AVX512, "-mavx512bf16", "-DORDERED_ISA_AVX512BF16"],
    "avx512": [*_AVX512, "-DORDERED_ISA_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-DORDERED_ISA_AVX2"],
    PORTABLE: ["-O1", "-DORDERED_ISA_PORTABLE"],  # -O1: a quick build (its speed does not matter)
    PORTABLE_DP: ["-O1", "-DORDERED_ISA_PORTABLE", "-DORDERED_PORTABLE_DP"],
}
CPU_NEEDS = {
    "avx512bf16": ("avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx2": ("avx2", "fma"),
}
# No -march=native: the code (and so nothing about the bits) must not depend on the build host.
# -ffp-contract=off: every FMA is one written in the source.
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared"]
V1_STILL_RUNS = "contract v1 (contract=qwen3_dense_v1) still runs"


class OrderedKernelsUnavailable(RuntimeError):
    """The ordered kernels cannot run here (no compiler, a CPU without AVX2+FMA, a failed build)."""


def isa_paths() -> list[str]:
    """The instruction-set paths this CPU can run, best first."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = cpu_flags()
    return [p for p in PATHS if all(f in have for f in CPU_NEEDS[p])]


def chosen_path() -> str:
    """TONPOLICY_ORDERED_ISA if set (it must be a path this CPU runs), else the best path."""
    can = isa_paths()
    want = os.environ.get(ISA_ENV, "").strip()
    if want:
        if want not in PATHS:
            raise OrderedKernelsUnavailable(f"{ISA_ENV}={want!r}: not one of {'|'.join(PATHS)}")
        if want not in can:
            need = " ".join(CPU_NEEDS[want])
            raise OrderedKernelsUnavailable(
                f"{ISA_ENV}={want}: this CPU cannot run it (needs {need}; the CPU's flags: "
                f"{' '.join(sorted(cpu_flags())) or 'none read'})"
            )
        return want
    if not can:
        raise OrderedKernelsUnavailable(
            f"the ordered GEMM needs an x86-64 CPU with AVX2 and FMA (this one: {platform.machine()}, flags: "
            f"{' '.join(sorted(cpu_flags())) or 'none read'}); {V1_STILL_RUNS}"
        )
    return can[0]
