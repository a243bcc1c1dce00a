"""The host description (tonpolicy.cpu_numerics) and the host check's refusal: a probe forced to fail
stops the job with exit 2 before any process starts, naming the CPU, the libraries, the shape and the
property; the runtime fingerprint carries the host's numeric path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tonpolicy import cpu_numerics
from tonpolicy.config.compose import compose_config
from tonpolicy.contract.host import host_problems
from tonpolicy.contract.identity import build_info
from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.invariant.host_check import FORCE_FAIL_ENV, Shapes, probe


def test_cpu_info_reads_the_flags(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 106\n"
        "model name\t: Intel Xeon\nflags\t\t: fpu fma avx2 avx512f avx512_vnni\n\nprocessor\t: 1\n"
    )
    info = cpu_numerics.cpu_info.__wrapped__(f)
    assert info == {
        "model_name": "Intel Xeon",
        "vendor": "GenuineIntel",
        "family_model": "6/106",
        "flags": ["fma", "avx2", "avx512f", "avx512_vnni"],
    }
    assert cpu_numerics.cpu_info.__wrapped__(tmp_path / "missing")["flags"] == []


def test_fingerprint_build_carries_the_host_path(monkeypatch) -> None:
    info = build_info("cpu")
    assert info["cpu"]["flags"] == cpu_numerics.cpu_info()["flags"]
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert build_info("cpu")["isa_caps"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_probe_passes_here_and_fails_when_forced(monkeypatch) -> None:
    s = Shapes(128, 384, 8, 4, 32, 2003, "float32", 4, 32)
    assert probe(get_kernels("invariant"), s) == []
    monkeypatch.setenv(FORCE_FAIL_ENV, "linear.row_count")
    failed = probe(get_kernels("invariant"), s)
    assert [f.prop for f in failed] == ["linear.row_count", "linear.row_count"]
    # the plain kernels fail the probe on their own (negative control)
    monkeypatch.delenv(FORCE_FAIL_ENV)
    assert {f.prop for f in probe(get_kernels("plain"), s)} & {"linear.row_count", "attention.prefill_vs_decode"}


def test_default_job_passes_the_host_check() -> None:
    for dtype in ("bfloat16", "float32"):
        cfg = compose_config([f"contract.dtype={dtype}"])
        assert host_problems(cfg.model, cfg.contract) == []


def test_a_failing_host_check_refuses_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, FORCE_FAIL_ENV: "attention.prefill_vs_decode"}
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", "experiment.steps=1", "logger=none", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "tonpolicy: invalid configuration" in err and "host check failed: attention.prefill_vs_decode" in err
    assert cpu_numerics.cpu_info()["model_name"] in err and "torch" in err and "D=32" in err
    # nothing started: no checkpoint, no logs, no plan; only the summary of the refusal (and Hydra's own)
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "__main__.log", "summary.json"]


def test_hosts_of_another_cpu_class_differ_in_the_runtime_fingerprint() -> None:
    """Under v1 a trainer and a server whose CPUs take other vector paths compute other bits in torch's row-local ops:
    their runtime identities differ, naming the CPU (the handshake refuses such a pair with exit 6)."""
    from tonpolicy.contract.identity import runtime_differences, runtime_identity

    kernels = get_kernels("invariant")
    ours = runtime_identity(kernels, "bfloat16", "cpu")
    theirs = runtime_identity(kernels, "bfloat16", "cpu")
    assert ours["fingerprint"] == theirs["fingerprint"]
    mine = ours["build"]["cpu"]
    other_vendor = "GenuineIntel" if mine.get("vendor") == "AuthenticAMD" else "AuthenticAMD"  # not this host's
    other_flags = ["fma"] if mine.get("flags") == ["fma", "avx2"] else ["fma", "avx2"]
    theirs["build"]["cpu"] = {"vendor": other_vendor, "flags": other_flags}
    theirs["build"]["isa_caps"] = {
        "ATEN_CPU_CAPABILITY": "avx2" if ours["build"]["isa_caps"] != {"ATEN_CPU_CAPABILITY": "avx2"} else "default"
    }
    diff = runtime_differences(ours, theirs)
    assert {"build.cpu.flags", "build.cpu.vendor", "build.isa_caps.ATEN_CPU_CAPABILITY"} <= set(diff), diff
