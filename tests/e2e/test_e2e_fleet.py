"""A fleet of rollout servers behind sglang-router (rollout.replicas=2): exact zero whichever replica
served a sample, per-token weight versions in the records, and a dead replica ends the run (exit 4)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from support.e2e_common import pid_alive, records, run_job, start_job, summary, wait_for


def _samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_two_replicas_hold_exact_zero_with_versions_per_token(tmp_path: Path) -> None:
    """Distributed weight sync into both replicas (one group); the router spreads each step's samples
    over them; every token carries the version that sampled it (step 0: the initial weights, step 1:
    the update after step 0). With an API key: the router checks it and forwards it to the replicas,
    and no file of the run holds it."""
    key = "fleet-test-key-0123456789"
    proc, run_dir = run_job(
        tmp_path,
        "rollout.replicas=2",
        "rollout.weight_sync=distributed",
        "rollout.require_api_key=true",
        "experiment.steps=2",
        timeout=300,
        env={"TONPOLICY_API_KEY": key},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not [p for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert "2 rollout servers (embedded) healthy" in proc.stderr and "behind sglang-router" in proc.stderr
    recs = records(run_dir)
    assert [r["mismatched_tokens"] for r in recs] == [0, 0] and all(r["tokens_scored"] > 0 for r in recs)
    assert [r["policy_version"] for r in recs] == [0, 1]
    assert recs[0]["weight_versions"] == {"default": recs[0]["tokens_scored"]}
    assert recs[1]["weight_versions"] == {"step_1": recs[1]["tokens_scored"]}
    samples = _samples(run_dir)
    for step, version in ((0, "default"), (1, "step_1")):
        per_token = samples[step]["weight_versions"]
        assert [len(v) for v in per_token] == [len(r) for r in samples[step]["responses"]]
        assert {v for sample in per_token for v in sample} == {version}
    s = summary(run_dir)
    # one request per sample, round robin: each replica served half of the 2 x 8 samples
    assert s["replica_requests"] == [8, 8] and s["rollout"] == "embedded tp1 x2 replicas"
    plan = json.loads((run_dir / "launch_plan.json").read_text())
    assert len(plan["rollout"]["replica_commands"]) == 2 and "sglang_router.launch_router" in plan["rollout"][
        "router_command"]  # fmt: skip


def test_two_replicas_off_policy_show_the_mismatch(tmp_path: Path) -> None:
    """Negative control: plain kernels on both sides of the same fleet; the gate reports the mismatch."""
    proc, run_dir = run_job(tmp_path, "rollout.replicas=2", "contract=off_policy", "experiment.steps=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert records(run_dir)[0]["mismatched_tokens"] > 0


def test_a_replica_that_dies_ends_the_run(tmp_path: Path) -> None:
    """kill -9 of one replica mid-run: exit 4 within seconds, naming it; completed steps on disk; no
    process of the job left (every child's process group is empty)."""
    proc, run_dir = start_job(tmp_path, "rollout.replicas=2", "experiment.steps=50")
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first step")
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"rollout-0", "rollout-1", "rollout-router", "trainer"}
    os.kill(pids["rollout-1"], signal.SIGKILL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 4 and "rollout 1 died" in err, err[-3000:]
    assert summary(run_dir)["steps_completed"] >= 1 and len(records(run_dir)) >= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_group_alive(p) for p in pids.values()):
        time.sleep(0.1)
    assert not any(_group_alive(p) for p in pids.values()), pids


def _group_alive(pgid: int) -> bool:
    """Any live process in the process group a child leads (the router runs a process of its own)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # members that are only zombies count as gone
    members = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid]
    return any(pid_alive(int(p)) for p in members)


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[2])
    except (OSError, ValueError, IndexError):
        return None
