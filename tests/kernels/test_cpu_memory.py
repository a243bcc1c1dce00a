"""tonpolicy.cpu_memory: the malloc settings a tonpolicy process gets from tune_malloc (glibc), a user's own
MALLOC_* variables left to win, and what they are for: a large temporary served from the heap again,
not page-faulted in anew (its first write costs what a rewrite of warm memory costs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

GLIBC = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc") if hasattr(os, "confstr") else False


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_import_sets_both_thresholds_and_a_user_value_wins() -> None:
    code = "import tonpolicy.cpu_memory as m; print(sorted(m.tune_malloc()))"
    assert _run(code) == str(sorted(["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]))
    assert _run(code, MALLOC_TRIM_THRESHOLD_="0") == str(["MALLOC_MMAP_THRESHOLD_"])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_prefill_sized_temporaries_are_not_page_faulted_in_again() -> None:
    """The contract's RMSNorm of a [2048, 1024] bf16 prefill (8 MiB fp32 temporaries), the median of six
    rounds of five calls (a round now and then takes the kernel's own faults, e.g. page migration): under
    the settings its temporaries reuse the heap's pages (a few faults); negative control: with
    the user's own thresholds at glibc's initial 128 KiB each is mapped afresh and faulted in (thousands
    per call)."""
    code = (
        "import resource, statistics, torch\n"
        "from tonpolicy.cpu_memory import tune_malloc\n"
        "from tonpolicy.kernels import pointwise\n"
        "tune_malloc()\n"
        "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "x, w = torch.randn(2048, 1024).bfloat16(), torch.ones(1024).bfloat16()\n"
        "pointwise.rms_norm(x, w, 1e-6)\n"
        "rounds = []\n"
        "for _ in range(6):\n"
        "    f0 = faults()\n"
        "    for _ in range(5): pointwise.rms_norm(x, w, 1e-6)\n"
        "    rounds.append((faults() - f0) // 5)\n"
        "print(int(statistics.median(rounds)))"
    )
    tuned = int(_run(code))
    plain = int(_run(code, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072"))
    print("page faults per call, tuned / 128 KiB thresholds:", tuned, plain)
    assert plain > 1000 and tuned * 20 < plain
