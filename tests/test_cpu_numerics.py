"""The CPU GEMM settings tonpolicy pins (tonpolicy.cpu_numerics): where they apply, that a user's value
wins, and that the contract's linear is row-invariant with them and, on an AMX CPU, not without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tonpolicy import cpu_numerics
from tonpolicy.config.compose import compose_config
from tonpolicy.launch.plan import environment

# Row-invariance of the contract's linear in a fresh process (the settings act at a process's first GEMM):
# prints how many row slices differ from the same rows inside the full batch.
PROBE = """
import torch
from tonpolicy.kernels import get_kernels
k, g, bad = get_kernels("invariant"), torch.Generator().manual_seed(0), 0
for dt in (torch.float32, torch.bfloat16):
    for kk, n in ((1024, 1024), (128, 256), (1024, 3072)):
        x = torch.randn(300, kk, generator=g).to(dt)
        w = (torch.randn(n, kk, generator=g) * kk**-0.5).to(dt)
        full = k.linear(x, w)
        for m, off in ((1, 0), (2, 144), (7, 200), (16, 46)):
            bad += int(not torch.equal(k.linear(x[off : off + m], w), full[off : off + m]))
print(bad)
"""


def _mismatches(env: dict[str, str]) -> int:
    base = {k: v for k, v in os.environ.items() if k not in cpu_numerics.AMX_SETTINGS}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=base | env, capture_output=True, text=True, timeout=300, check=True
    )
    return int(out.stdout.split()[-1])


def test_has_amx_reads_the_cpu_flags(tmp_path: Path) -> None:
    amx, avx = tmp_path / "amx", tmp_path / "avx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile avx512_fp16\n")
    avx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512bw\n")
    assert cpu_numerics.has_amx(amx) and not cpu_numerics.has_amx(avx)
    assert not cpu_numerics.has_amx(tmp_path / "missing")


def test_settings_only_on_amx_and_a_users_value_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_numerics, "has_amx", lambda: False)
    assert cpu_numerics.cpu_numerics_env() == {}
    assert not set(cpu_numerics.AMX_SETTINGS) & set(environment(compose_config([]), "cpu"))
    monkeypatch.setattr(cpu_numerics, "has_amx", lambda: True)
    assert environment(compose_config([]), "cpu").items() >= cpu_numerics.AMX_SETTINGS.items()
    assert not set(cpu_numerics.AMX_SETTINGS) & set(environment(compose_config([]), "cuda"))
    # Without the contract (stock SGLang, the off_policy control) the libraries keep their fast paths.
    assert not set(cpu_numerics.AMX_SETTINGS) & set(environment(compose_config(["contract=off_policy"]), "cpu"))
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_numerics.pin_cpu_numerics() == {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def test_contract_linear_is_row_invariant_with_the_settings_and_not_without_them_on_amx() -> None:
    """With what importing tonpolicy sets, no row slice differs on any CPU. Control: with both libraries
    at their own defaults (a user's value is kept), an AMX CPU gives row-count dependent bits (the reason
    for the settings), and any other CPU still gives none (the reason they apply to AMX only)."""
    assert _mismatches({}) == 0
    defaults = _mismatches({"MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "ALL"})
    assert defaults > 0 if cpu_numerics.has_amx() else defaults == 0
