"""What this host's numerics are: the CPU (model, the flags that pick library code paths) and the
variables that cap those paths. Nothing here changes a library's behaviour.

The contract's GEMMs no longer depend on the CPU's BLAS (tonpolicy.kernels.invariant.exact_gemm computes them
exactly); the remaining ops (exp, sums of a fixed length) run through torch's vectorised kernels, whose
paths follow the CPU's instruction set and these variables. So the runtime fingerprint carries this
description (two hosts of different classes are refused at the handshake), and the host check
(tonpolicy.kernels.invariant.host_check) probes the invariances on the host itself before a job starts.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

# Variables that send torch's, MKL's and oneDNN's dispatch down other instruction sets.
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
# CPU flags that decide which vector code the libraries run (Linux's names).
NUMERIC_FLAGS = ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve")


@functools.cache  # the CPU does not change under a process: read /proc/cpuinfo once
def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """Model name, vendor, family/model numbers and the numeric flags of this CPU (Linux; 'unknown'
    where they cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with cpuinfo.open() as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "model_name": fields.get("model name", fields.get("CPU part", "unknown")),
        "vendor": fields.get("vendor_id", fields.get("CPU implementer", "unknown")),
        "family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
        "flags": [f for f in NUMERIC_FLAGS if f in flags],
    }


def has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has AMX tiles."""
    return "amx_tile" in cpu_info(cpuinfo)["flags"]


def isa_caps() -> dict[str, str]:
    """The instruction-set caps this process runs under (only those set)."""
    return {k: os.environ[k] for k in ISA_VARIABLES if k in os.environ}


def describe_host() -> str:
    """One line naming the CPU, its numeric flags and the caps in force (for error messages)."""
    c = cpu_info()
    caps = ", ".join(f"{k}={v}" for k, v in isa_caps().items()) or "no caps set"
    flags = " ".join(c["flags"])
    return f"{c['model_name']} (vendor {c['vendor']}, family/model {c['family_model']}; flags {flags}; {caps})"
