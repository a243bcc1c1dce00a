"""Faults end every child within seconds, exit non-zero, say where the logs are, keep completed steps."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from support.e2e_common import pid_alive, records, run_job, start_job, summary, wait_for

from tonpolicy.launch.watchdog import descendants


def _assert_all_gone(run_dir: Path) -> None:
    pids = json.loads((run_dir / "pids.json").read_text())
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids.values()), pids


def test_launcher_killed_with_sigkill_leaves_no_orphans(tmp_path: Path) -> None:
    """`kill -9` of the launcher: its watchdog ends the server, torchrun and every rank within 10 s;
    the completed steps' records stay."""
    proc, run_dir = start_job(tmp_path, "parallel=tp2", "experiment.steps=50")
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first step")
    pids = json.loads((run_dir / "pids.json").read_text())
    members = descendants(list(pids.values()))
    assert len(members) > len(pids), "the ranks are below torchrun"
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in members), [p for p in members if pid_alive(p)]
    assert len(records(run_dir)) >= 1


def test_trainer_rank_dies(tmp_path: Path) -> None:
    proc, run_dir = run_job(tmp_path, "parallel=tp2", "experiment.steps=3", env={"TONPOLICY_FAULT": "rank_exit:1:1"})
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "trainer exited" in proc.stderr and str(run_dir / "logs") in proc.stderr
    assert [r["step"] for r in records(run_dir)] == [0]  # the completed step survived
    assert summary(run_dir)["status"] == "failed"
    _assert_all_gone(run_dir)


def test_server_dies_mid_run(tmp_path: Path) -> None:
    proc, run_dir = start_job(tmp_path, "parallel=tp1", "experiment.steps=50")
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first step")
    pids = json.loads((run_dir / "pids.json").read_text())
    os.kill(pids["rollout"], signal.SIGKILL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 4 and "rollout server died" in err, err[-3000:]
    assert len(records(run_dir)) >= 1 and summary(run_dir)["steps_completed"] >= 1
    _assert_all_gone(run_dir)


def test_server_that_hangs_is_detected(tmp_path: Path) -> None:
    """One server that stops answering (SIGSTOP) ends the run with exit 4 within seconds, naming it and
    the key, records intact, nothing left (a fleet's member is ended and replaced instead:
    test_e2e_fleet.py)."""
    proc, run_dir = start_job(tmp_path, "parallel=tp1", "experiment.steps=50", "rollout.liveness_timeout_s=5")
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first step")
    pids = json.loads((run_dir / "pids.json").read_text())
    os.kill(pids["rollout"], signal.SIGSTOP)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 4 and "rollout server stopped answering /health" in err, err[-3000:]
    assert "rollout.liveness_timeout_s=5" in err
    assert summary(run_dir)["steps_completed"] >= 1 and len(records(run_dir)) >= 1
    _assert_all_gone(run_dir)


def test_ctrl_c(tmp_path: Path) -> None:
    proc, run_dir = start_job(tmp_path, "parallel=tp1", "experiment.steps=50")
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first step")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert summary(run_dir)["status"] == "interrupted" and summary(run_dir)["steps_completed"] >= 1
    _assert_all_gone(run_dir)


def test_server_never_healthy(tmp_path: Path) -> None:
    fake = tmp_path / "fake_python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import time; time.sleep(600)'\n")
    fake.chmod(0o755)
    t0 = time.monotonic()
    proc, run_dir = run_job(
        tmp_path,
        "rollout=sglang",
        "trainer.device=cuda",
        f"rollout.python={fake}",
        "rollout.health_timeout_s=3",
        timeout=120,
    )
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "not healthy after 3s" in proc.stderr and "rollout.health_timeout_s" in proc.stderr
    assert time.monotonic() - t0 < 60
    assert not (run_dir / "pids.json").exists()  # the trainer never started


def test_port_already_taken(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc, run_dir = run_job(tmp_path, f"rollout.port={port}", timeout=120)
    assert proc.returncode == 5
    assert f"rollout.port={port}: port already in use" in proc.stderr


def test_full_disk_shows_the_root_cause(tmp_path: Path) -> None:
    """A rank that hits ENOSPC: the user sees that exception line (not torchrun's ChildFailedError) and the log."""
    proc, run_dir = run_job(
        tmp_path, "parallel=tp1", "experiment.steps=3", env={"TONPOLICY_FAULT": "rank_disk_full:0:1"}
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "trainer exited with 1: OSError: [Errno 28] No space left on device" in proc.stderr, proc.stderr[-3000:]
    assert f"full log: {run_dir / 'logs' / 'trainer.log'}" in proc.stderr
    assert [r["step"] for r in records(run_dir)] == [0]
    _assert_all_gone(run_dir)


def test_a_planted_rollout_mismatch_fails_the_default_job_with_no_update(tmp_path: Path) -> None:
    """The default job has no recompute: the gate compares the rollout's logprobs with the first training
    forward. One rollout logprob one bit off (TONPOLICY_FAULT=flip_rollout_logprob) fails step 0 with
    exit 3, the record names that check, and nothing was trained or synced."""
    proc, run_dir = run_job(
        tmp_path, "parallel=tp1", "experiment.steps=2", env={"TONPOLICY_FAULT": "flip_rollout_logprob"}
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "parity gate failed at step 0" in proc.stderr and "first training forward" in proc.stderr
    (rec,) = records(run_dir)
    assert rec["recompute"] is False and rec["gate"] == "failed"
    assert rec["gate_check"] == "rollout_vs_first_training_forward" and rec["mismatched_tokens"] == 1
    assert rec["update_successful"] == 0.0 and summary(run_dir)["status"] == "gate_failed"
    assert not (run_dir / "checkpoints" / "step_1").exists()
