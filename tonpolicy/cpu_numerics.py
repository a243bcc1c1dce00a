"""The CPU GEMM settings the contract's bits rest on, set in every tonpolicy process before its first GEMM.

The invariant kernels rely on measured properties of the CPU's GEMM libraries (MKL for fp32, oneDNN for
bf16): a row's bits do not depend on the row count (any multiple of 4), the column count or the thread
count. On AVX512 CPUs without AMX they hold as the libraries come. On CPUs with AMX (Sapphire Rapids and
later) they do not (measured on one such host: 17 of the kernels' invariance tests failed, and the default
job's gate failed at step 0 with 14 of 64 tokens differing): MKL's fp32 GEMM takes row-count dependent
paths there, and oneDNN's bf16 GEMM runs AMX tiles for some row counts only. On such a CPU, MKL's strict
conditional-numerical-reproducibility mode and oneDNN capped below AMX restore them (the same host: the
invariance tests pass, the default job holds exact zero for 24 steps in fp32 at TP1 and bf16 at TP2).
Both libraries read these variables at their first call, so importing tonpolicy sets them (a value the
user set is kept), and the launch plan's environment carries them to the processes of a job under the
contract (a server without it, stock SGLang, keeps the libraries' fast paths).
Their cost there (experiments/bench_cpu_numerics.py): oneDNN's bf16 GEMM below AMX is ~3.5-4.5x slower at
64-512 rows, so bf16 prefill ~3.3x (contract) and ~5x (plain kernels) slower; fp32 is unaffected. AMX stays
off because no fixed padding rule recovers the bits with it: a bf16 GEMM's row bits there depend on the
row count in a shape-dependent way (for some weights every count up to 128 differs from 512) and, for
small-N/large-K weights, on the thread count.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# What an AMX CPU needs; other CPUs keep the libraries' own paths (their bits are the measured ones).
AMX_SETTINGS = {"MKL_CBWR": "AUTO,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


@functools.cache  # the CPU does not change under a process: read its flags once (plans, tests ask often)
def has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has AMX tiles (Linux's CPU flags; False where they cannot be read)."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def cpu_numerics_env() -> dict[str, str]:
    """The variables this CPU's processes need (empty where the libraries' defaults hold)."""
    return dict(AMX_SETTINGS) if has_amx() else {}


def pin_cpu_numerics() -> dict[str, str]:
    """Set this process's variables unless the user set them; returns what the process now has."""
    for key, value in cpu_numerics_env().items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in AMX_SETTINGS if k in os.environ}


def amx_settings_active() -> bool:
    """Whether this process runs under the AMX settings (an AMX CPU, the values not overridden)."""
    return has_amx() and all(os.environ.get(k) == v for k, v in AMX_SETTINGS.items())
