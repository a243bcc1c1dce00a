"""glibc malloc settings for every tonpolicy process: temporaries of up to MMAP_THRESHOLD bytes come from
the heap and stay there when freed (up to TRIM_THRESHOLD of free heap is kept), instead of fresh
zero-filled pages per tensor.

Why: by default glibc serves a large block with mmap and returns the heap's free top to the kernel, so
each prefill-sized temporary (a [2048, 1024] fp32 activation is 8 MiB) is page-faulted in again on
every op. On a 2-core VM that is most of an elementwise op's time (measured, [2048, 1024] bf16 RMSNorm:
18 ms with glibc's defaults, 1.3 ms with these; the invariant kernels' fp32 temporaries make them pay
more than plain kernels). The process keeps its peak heap instead of returning it; values are unchanged
(allocation never touches arithmetic). Set at import, like the GEMM settings (tonpolicy.cpu_numerics);
the variables MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, when the user set them, win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's largest mmap threshold (64-bit: 4 MiB * sizeof(long)); larger blocks are rare and long-lived.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (malloc.h)


def tune_malloc() -> dict[str, int]:
    """Apply the settings to this process (glibc only); returns what was set (empty elsewhere)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators differ; leave them be
        return {}
    if mallopt is None:
        return {}
    done = {}
    for env, param, value in (
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ):
        if env not in os.environ and mallopt(param, value) == 1:
            done[env] = value
    return done
