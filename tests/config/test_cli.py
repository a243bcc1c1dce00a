"""`python -m tonpolicy` as a user runs it: plan mode, bad input, a Hydra multirun sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def tonpolicy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tonpolicy", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_plan_mode_writes_plan_and_script(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = tonpolicy(
        "mode=plan",
        "contract=qwen3_dense_v2",
        "model=qwen3_4b",
        "parallel=tp2_pp2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((run_dir / "launch_plan.json").read_text())
    assert plan["layout"] == "tp2_pp2" and plan["model"] == "qwen3_4b"
    assert json.loads(proc.stdout[: proc.stdout.rindex("}") + 1]) == plan
    script = run_dir / "launch.sh"
    assert script.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert (run_dir / "resolved_config.yaml").exists()


def test_invalid_config_exits_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = tonpolicy("parallel.tp=3", "experiment.temperature=0", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "parallel.tp=3: must divide model.num_attention_heads=8" in proc.stderr
    assert "experiment.temperature=0.0: must be finite and >= 1e-06" in proc.stderr
    assert not (run_dir / "launch_plan.json").exists()


def test_cfg_job_and_help(tmp_path: Path) -> None:
    proc = tonpolicy("--cfg", "job", "parallel=cp2_ring", cwd=tmp_path)
    assert proc.returncode == 0 and "cp_type: ring" in proc.stdout
    proc = tonpolicy("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "tonpolicy" in proc.stdout
    # The groups as Hydra lists them, without the base_<group> schemas the options extend.
    assert "\ntask: calculator, constant, digit_copy, echo_digit, first_digit, first_parity\n" in proc.stdout
    assert "\ntrainer: megatron\n" in proc.stdout and "base_" not in proc.stdout


def test_multirun_sweep_one_dir_per_job(tmp_path: Path) -> None:
    layouts = ["tp1", "tp2", "tp4", "pp2", "tp2_pp2", "cp2_ulysses", "cp2_ring"]
    proc = tonpolicy(
        "-m", "mode=plan", f"parallel={','.join(layouts)}", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    plans = sorted((tmp_path / "sweep").glob("*/launch_plan.json"))
    assert sorted(json.loads(p.read_text())["layout"] for p in plans) == sorted(layouts)


def test_rendered_launch_script_runs_the_job(tmp_path: Path) -> None:
    """`launch.sh` from a plan is runnable as it stands: init weights, server, trainer ranks."""
    from support.e2e_common import FAST, records

    from tonpolicy.ports import free_port

    run_dir = tmp_path / "run"
    proc = tonpolicy(
        "mode=plan",
        "parallel=tp2",
        "experiment.steps=1",
        *FAST,
        f"rollout.port={free_port()}",
        f"trainer.master_port={free_port()}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(run_dir / "launch.sh")], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = records(run_dir)
    assert rec["tokens_scored"] > 0 and rec["mismatched_tokens"] == 0


def test_sweep_goes_on_past_a_failed_job_and_exits_non_zero(tmp_path: Path) -> None:
    from support.e2e_common import FAST

    sweep = tmp_path / "sweep"
    proc = tonpolicy(
        "-m",
        "mode=run",
        "experiment.steps=1",
        *FAST,
        "parallel=tp1",
        "parallel.tp=1,3",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    statuses = sorted(json.loads(p.read_text())["status"] for p in sweep.glob("*/summary.json"))
    assert statuses == ["invalid_config", "ok"]
    assert "parallel.tp=3: must divide" in proc.stderr
    table = (sweep / "sweep_summary.md").read_text()
    assert "invalid_config" in table and "| ok " in table
