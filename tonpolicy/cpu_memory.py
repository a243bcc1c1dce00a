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

Also here: another process tree's peak resident memory (the rollout server's, as the step record holds it).
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


# --- peak memory of other processes (the rollout servers, as the trainer records them) --------------


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (SGLang's server runs its scheduler and detokenizer as children);
    empty when `pid` is gone. psutil where it is installed, else Linux's /proc."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            return [pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.Error:
            return []
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'
                parents[int(entry.name)] = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    if pid not in parents:
        return []
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def peak_rss_kib(pid: int) -> int | None:
    """A process's peak resident memory so far (the kernel's high-water mark, VmHWM; KiB); None where
    /proc does not say (the process is gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_peak_rss_mib(pid: int) -> float | None:
    """The sum of the peaks of `pid`'s process tree (MiB): each process's own high-water mark, so a bound
    on the tree's peak that is reached when the processes peak together; None where none can be read."""
    peaks = [k for k in map(peak_rss_kib, process_tree(pid)) if k is not None]
    return round(sum(peaks) / 1024, 1) if peaks else None
