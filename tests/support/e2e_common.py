"""Helpers for end-to-end tests: run `python -m tonpolicy` as a user would, in a temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support.tied_to_suite import tied_to_suite

# Short steps on the copy task (graded rewards vary within a group, so every step has a gradient),
# sampled from the whole vocabulary (not the default run's top 16): long, varied responses.
FAST = [
    "experiment.top_k=-1",
    "experiment.prompts_per_step=2",
    "experiment.samples_per_prompt=4",
    "experiment.max_prompt_len=12",
    "experiment.max_new_tokens=6",
    "task=digit_copy",
    "task.graded_tokens=6",
    "logger=none",
]


def with_fast(*overrides: str) -> list[str]:
    # A test's own value for a key of FAST replaces FAST's (a key given twice would stand, with a warning).
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    return [*(o for o in FAST if o.partition("=")[0] not in given), *overrides]


def tonpolicy_argv(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "tonpolicy", "mode=run", *with_fast(*overrides), f"hydra.run.dir={run_dir}"]


def run_sweep(tmp_path: Path, layouts: list[str], overrides: list[str]) -> tuple[Path, list[Path]]:
    """`python -m tonpolicy -m mode=run <overrides> parallel=<layouts>` as a user sweeps: checks it exits 0
    with one finished job per layout; returns the sweep folder and the jobs' run folders."""
    sweep = tmp_path / "sweep"
    argv = [sys.executable, "-m", "tonpolicy", "-m", "mode=run", *overrides]
    argv += [f"parallel={','.join(layouts)}", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert sorted(summary(j)["layout"] for j in jobs) == sorted(layouts)
    return sweep, jobs


def run_job(tmp_path: Path, *overrides: str, timeout: float = 400, env: dict[str, str] | None = None):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        tonpolicy_argv(run_dir, *overrides),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return proc, run_dir


def start_job(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        tied_to_suite(tonpolicy_argv(run_dir, *overrides)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return proc, run_dir


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def samples(run_dir: Path) -> list[dict]:
    """Each step's samples (prompts, responses, rewards, ...), as samples.jsonl holds them."""
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
