"""The instruction-set matrix: the host check, the contract GEMM's bits, the kernels' invariance tests
and a 2-step default job under capped instruction sets, which send torch's, MKL's and oneDNN's dispatch
down the paths of older CPUs. Every cell holds exact zero (or would be refused by the host check);
the contract GEMM gives the same bits in every cell (it depends on no library path); and the strategy
the kernels had before it (library GEMMs in fixed row tiles) fails at least one cell: the negative
control, the matrix would have caught the Ice Lake failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.e2e_common import records

from tonpolicy.cpu_numerics import ISA_VARIABLES, cpu_info
from tonpolicy.kernels.invariant import ordered_gemm

pytestmark = pytest.mark.slow  # a fresh interpreter per instruction-set cell

TESTS = Path(__file__).resolve().parents[1]
FLAGS = set(cpu_info()["flags"])
HAS_AVX512 = "avx512f" in FLAGS
# A cap at or above what this CPU has changes no dispatch: such a cell is the host cell, which the suite's
# own run covers, so only caps below the host are cells.
NO_VECTOR_ISA = {"ATEN_CPU_CAPABILITY": "default"}
LAPTOP = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CELLS: list[dict[str, str]] = [{}, NO_VECTOR_ISA]
if HAS_AVX512:
    CELLS += [
        {"ATEN_CPU_CAPABILITY": "avx2"},
        {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        {"ONEDNN_MAX_CPU_ISA": "AVX2"},
        LAPTOP,
    ]
if FLAGS & {"avx512_vnni", "avx512_bf16", "amx_tile"}:
    CELLS += [{"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}]
if "avx512_bf16" in FLAGS and "amx_tile" in FLAGS:
    CELLS.append({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
# Contract v2's own paths other than the one this CPU picks (the pair instruction, its AVX-512 and AVX2
# emulations), each forced; the host cell runs the one it picks.
ORDERED_CELLS = [
    {ordered_gemm.ISA_ENV: path} for path in ordered_gemm.isa_paths() if path != ordered_gemm.chosen_path()
]
CELLS += ORDERED_CELLS
# Cells that also run a 2-step default job; every cell runs the kernel invariance tests. The host's job is
# the e2e tests' own, so the jobs run where dispatch is capped: no vector ISA and, on an AVX-512 CPU, an
# AVX2 laptop.
DEEP = [i for i, cell in enumerate(CELLS) if cell in (NO_VECTOR_ISA, LAPTOP)]
KERNEL_TESTS = [
    "kernels/test_kernels_linear.py",
    "kernels/test_kernels_pointwise.py",
    "kernels/test_kernels_attention.py",
    "kernels/test_exact_gemm.py",
]


def _env(cell: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ISA_VARIABLES and k != ordered_gemm.ISA_ENV}
    return base | cell | {"PYTHONPATH": str(TESTS)}


def _name(cell: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in cell.items()) or "host"


@pytest.fixture(scope="module")
def cells() -> dict[str, dict]:
    out = {}
    for cell in CELLS:
        proc = subprocess.run(
            [sys.executable, str(TESTS / "support" / "isa_cell.py")],
            env=_env(cell),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[_name(cell)] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_every_cell_passes_the_host_check(cells: dict[str, dict]) -> None:
    failed = {name: c["problems"] for name, c in cells.items() if c["problems"]}
    assert not failed, failed


def test_contract_gemm_bits_are_the_same_in_every_cell(cells: dict[str, dict]) -> None:
    hashes = {name: c["gemm_hash"] for name, c in cells.items()}
    assert len(set(hashes.values())) == 1, hashes
    # the cells really took other paths: torch's vector ISA moved
    assert len({c["capability"] for c in cells.values()}) >= 2


def test_v2_forward_bits_are_the_same_in_every_cell(cells: dict[str, dict]) -> None:
    """A whole v2 forward (mixed batches, bf16 and fp32) gives the same bits in every cell: every compiled
    path this CPU runs (the pair instruction or its FMA emulations, forced one at a time) and every cap on
    torch's, MKL's and oneDNN's dispatch (v2 owns its exp, log, sums and GEMMs). Negative control: v1's
    forward, whose row-local ops are torch's, changes with torch's vector ISA in some cell."""
    assert {c["ordered_isa"] for c in cells.values()} == set(ordered_gemm.isa_paths())
    hashes = {name: c["forward_hash"] for name, c in cells.items()}
    assert len(set(hashes.values())) == 1, hashes
    assert len({c["v1_forward_hash"] for c in cells.values()}) > 1, cells


def test_v2_runtime_fingerprint_is_the_same_in_every_cell(cells: dict[str, dict]) -> None:
    """Engines under v2 on any of these CPU paths report one runtime fingerprint, so the handshake pairs a
    rollout server and a trainer of different CPU classes (the forward hashes above show they compute the
    same bits). Negative control: v1's fingerprint carries the host's vector path and moves with the caps."""
    assert len({c["runtime_fingerprint"] for c in cells.values()}) == 1, cells
    assert len({c["v1_runtime_fingerprint"] for c in cells.values()}) > 1, cells


def test_library_gemms_fail_some_cell(cells: dict[str, dict]) -> None:
    """Negative control: library GEMMs are not row-invariant in at least one cell: the pre-exact kernels'
    fixed 4-row tiles vs one 512-row GEMM (differ on Intel hosts), or a row alone vs inside the 512
    (on AMD hosts the 4-row tiles agree, the single row does not)."""
    assert any(c["old_mismatches"] + c["single_row_mismatches"] > 0 for c in cells.values()), cells


# The uncapped host (cell 0) is left out: the suite runs these very tests in its own process.
@pytest.mark.parametrize("index", range(1, len(CELLS)), ids=[_name(c) for c in CELLS[1:]])
def test_kernel_invariance_tests_pass_under_the_cell(index: int) -> None:
    cell = CELLS[index]
    # Contract v2's kernel tests (the [ordered-...] cases); v1's exact GEMM is covered by test_exact_gemm.py.
    # The cross-process combine is left to the suite's own run: it adds the cell's partials (whose bits the
    # single-process tests check here) with IEEE fp32 adds that no vector path changes.
    select = ["not [invariant-", "not across_gloo_ranks"]
    if cell.get("ATEN_CPU_CAPABILITY") in ("default", "avx2"):
        # torch's own bf16 SDPA raises below avx512 ("pack_vnni2 is only supported when avx512 is
        # supported"): the plain kernels' control cannot run in these cells; the contract's own tests all do.
        select.append("not test_plain_attention_prefill_differs_from_decode")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-qx", "-p", "no:cacheprovider", "-k", " and ".join(select), *KERNEL_TESTS],
        cwd=TESTS,
        env=_env(cell),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.parametrize("index", DEEP, ids=[_name(CELLS[i]) for i in DEEP])
def test_two_step_default_job_holds_exact_zero_under_the_cell(index: int, tmp_path: Path) -> None:
    """The README's main job (default experiment, 2 of its steps) under the cell."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "tonpolicy", "experiment.steps=2", "logger=none", f"hydra.run.dir={run_dir}"]
    env = _env(CELLS[index])
    env.pop("PYTHONPATH")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(run_dir)
    assert len(recs) == 2 and all(r["mismatched_tokens"] == 0 for r in recs), recs
