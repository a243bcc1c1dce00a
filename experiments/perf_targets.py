"""The performance targets the benchmarks check, and where their results go.

Each benchmark measures both sides in one run, prints every target as `measured / target pass|MISS` and
writes `results/<bench>.json`; `perf_report.py` turns those files into `results/perf_targets.md`,
`results/perf_targets.png` and README's table.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tonpolicy.cpu_numerics import has_amx

RESULTS = Path(__file__).resolve().parent / "results"

ENGINE_RATIO = 1.2  # embedded engine, contract time / plain time (prefill and decode)
TRAINER_RATIO = 1.1  # trainer step, kernel spec / stock spec
SGLANG_RATIO = 1.0  # embedded server (contract) tokens/s / stock SGLang tokens/s
MEMORY_RATIO = 1.1  # bytes held by a bf16 model under the contract / plain (weights + KV pool)
CONTEXT_RATIO = 1.5  # decode time per token at context 4096 / at context 512


def with_launch_environment() -> None:
    """Re-run this script under the CPU allocator settings tonpolicy's launch plan gives its processes
    (glibc reads them at start), so a benchmark measures what a launched job gets."""
    from tonpolicy.cpu_memory import CPU_ALLOCATOR_ENV

    if any(os.environ.get(k) != v for k, v in CPU_ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CPU_ALLOCATOR_ENV})


@dataclass
class Check:
    name: str
    measured: float
    target: float
    at_most: bool = True  # the measured value must be <= target (False: >=)
    # A row carried from an earlier run keeps what measured it and when (None: this run, this host).
    machine: dict[str, Any] | None = None
    date: str | None = None

    @property
    def passed(self) -> bool:
        return self.measured <= self.target if self.at_most else self.measured >= self.target

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        return f"{self.name}: {self.measured:.2f} / {sign} {self.target:.2f}  {'pass' if self.passed else 'MISS'}"


def job_steps(run_dir: Path) -> tuple[list[dict[str, Any]], list[float]]:
    """A finished job's step records and its steps' seconds: the wall time between consecutive records,
    from step 2 on (steps 0 and 1 warm up)."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = [r["time"] for r in recs]
    return recs, [b - a for a, b in zip(ends[1:], ends[2:], strict=False)]


def machine() -> dict[str, Any]:
    """What measured a row: the CPU (model name where the OS says it), cores, torch, AMX."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "amx": has_amx()}


def report(bench: str, checks: list[Check], data: dict[str, Any]) -> Path:
    """Print every target and write results/<bench>.json (checks, raw numbers, machine)."""
    print(f"\n{bench}: targets (measured / target)")
    for c in checks:
        print("  " + c.line())
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{bench}.json"
    date, host = time.strftime("%Y-%m-%d %H:%M"), machine()
    body = {
        "bench": bench,
        "date": date,
        "machine": host,
        # Each row with its own machine and date: perf_report.py may carry rows a quick run did not measure.
        "checks": [
            asdict(c) | {"passed": c.passed, "machine": c.machine or host, "date": c.date or date} for c in checks
        ],
        "data": data,
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"  -> {path}")
    return path
