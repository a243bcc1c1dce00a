"""glibc malloc settings for every tonpolicy process on a CPU host: blocks of up to 32 MiB (the largest
threshold glibc allows) come from the heap, and freed heap memory is kept, instead of an mmap, page faults
and an unmap per large temporary.

Why: with glibc's defaults each prefill-sized temporary (a [2048, 1024] fp32 activation is 8 MiB) is
page-faulted in again on every op; on a 2-core VM that is most of an elementwise op's time (measured,
a [2048, 1024] bf16 RMSNorm: 18 ms with the defaults, 1.8 ms with these; the tiny model's prefill 13%
faster under the contract kernels). A process keeps its peak heap instead of returning it; values are
unchanged (allocation never touches arithmetic).

Two ways in: the launch plan puts `CPU_ALLOCATOR_ENV` in the environment of every process it starts
(glibc reads it at start, any program: servers, trainer ranks), and `tune_malloc` applies the same values
to a running process with mallopt, called by the command line's entry (`python -m tonpolicy`) and by
whoever wants them (the test suite, benchmarks), never by an import: a library that other programs import
leaves their allocator alone. A value the user set in the environment wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
# mallopt's parameter numbers (malloc.h); its value is a C int, so the trim threshold is capped there.
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
_C_INT_MAX = 2**31 - 1


def tune_malloc() -> dict[str, int]:
    """Apply the settings to this process (glibc only); returns what was set (empty elsewhere)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # not glibc (musl, macOS): their allocators differ; leave them be
        return {}
    done = {}
    for env, value in CPU_ALLOCATOR_ENV.items():
        v = min(int(value), _C_INT_MAX)
        if env not in os.environ and mallopt(_MALLOPT[env], v) == 1:
            done[env] = v
    return done
