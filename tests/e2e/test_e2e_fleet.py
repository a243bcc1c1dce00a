"""A fleet of rollout servers behind sglang-router (rollout.replicas=2): exact zero whichever replica
served a sample, per-token weight versions in the records; a replica that hangs and a router killed
mid-run are replaced (under distributed weight sync: a new weight-update group) and the run holds exact
zero with the samples of the same run undisturbed; a death past rollout.max_restarts ends the run (exit 4)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from support.e2e_common import pid_alive, records, run_job, start_job, summary, wait_for

from tonpolicy.launch.trainer_main import ROLLOUT_ADDRESS_FILE
from tonpolicy.rollout.client import RolloutClient, RolloutError

KEY = "fleet-test-key-0123456789"
# The undisturbed run and the disturbed one share these: the same seeds, weight sync and key.
DISTRIBUTED = ["rollout.replicas=2", "rollout.weight_sync=distributed", "rollout.require_api_key=true"]


def _samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Two steps of a fleet under distributed weight sync, nothing disturbed: its stderr and run folder
    (the disturbed run below must reproduce its samples)."""
    proc, run_dir = run_job(
        tmp_path_factory.mktemp("undisturbed"),
        *DISTRIBUTED,
        "experiment.steps=2",
        timeout=300,
        env={"TONPOLICY_API_KEY": KEY},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr, run_dir


def _no_file_holds_the_key(run_dir: Path) -> None:
    assert not [p for p in run_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]


def test_two_replicas_hold_exact_zero_with_versions_per_token(undisturbed: tuple[str, Path]) -> None:
    """Distributed weight sync into both replicas (one group); the router spreads each step's samples
    over them; every token carries the version that sampled it (step 0: the initial weights, step 1:
    the update after step 0). With an API key: the router checks it and forwards it to the replicas,
    and no file of the run holds it."""
    stderr, run_dir = undisturbed
    _no_file_holds_the_key(run_dir)
    assert "2 rollout servers (embedded) healthy" in stderr and "behind sglang-router" in stderr
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


def _serving(urls: list[str], version: str) -> bool:
    try:
        return all(RolloutClient(u, timeout_s=5, api_key=KEY).model_info()["weight_version"] == version for u in urls)
    except RolloutError:
        return False


def test_a_hung_replica_and_a_killed_router_are_replaced_and_the_run_stays_exact(
    tmp_path: Path, undisturbed: tuple[str, Path]
) -> None:
    """The undisturbed run's configuration, disturbed: replica 1 stops answering (SIGSTOP) once both
    replicas serve step 1's weights, and the router is killed (-9) once step 1 is recorded. The hung
    replica is ended and started again from the initial weights (nothing else is on disk), unsynced;
    the trainer forms a new weight-update group with both replicas and sends it the current weights; the
    samples it answered before are re-sent, as are the ones lost with the router, with their rids and
    seeds. Every step holds exact zero, every token at the version of its step, and steps 0 and 1 are
    the undisturbed run's, bit for bit: tokens, logprobs, rewards, losses."""
    proc, run_dir = start_job(
        tmp_path, *DISTRIBUTED, "rollout.liveness_timeout_s=5", "experiment.steps=3", env={"TONPOLICY_API_KEY": KEY}
    )
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "step 0")
    replicas = json.loads((run_dir / ROLLOUT_ADDRESS_FILE).read_text())["replica_urls"]
    wait_for(lambda: _serving(replicas, "step_1"), 60, "step 1's weights on both replicas")
    os.kill(json.loads((run_dir / "pids.json").read_text())["rollout-1"], signal.SIGSTOP)
    wait_for(lambda: len(records(run_dir)) >= 2, 300, "step 1")
    os.kill(json.loads((run_dir / "pids.json").read_text())["rollout-router"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert "rollout 1 stopped answering /health for" in err and "rollout.liveness_timeout_s=5), ended" in err
    assert "starting it again from the initial weights; the trainer sends it weight version step_1" in err
    assert "rollout router died (exit -9); starting it again" in err
    _no_file_holds_the_key(run_dir)
    recs = records(run_dir)
    assert [r["mismatched_tokens"] for r in recs] == [0, 0, 0] and all(r["tokens_scored"] > 0 for r in recs)
    # the router's replacement lands in step 2's record; the replica's in whichever step saw it logged
    assert recs[2]["rollout_restarts"] >= 1 and sum(r["rollout_restarts"] for r in recs) == 2
    assert recs[2]["requests_resent"] + recs[2]["rollout_retries"] > 0
    assert [r["weight_versions"] for r in recs] == [
        {"default": recs[0]["tokens_scored"]},
        {"step_1": recs[1]["tokens_scored"]},
        {"step_2": recs[2]["tokens_scored"]},
    ]
    restarts = [json.loads(line) for line in (run_dir / "rollout_restarts.jsonl").read_text().splitlines()]
    assert [r["member"] for r in restarts] == ["rollout-1", "rollout-router"]
    assert restarts[0]["weight_version"] == "unsynced" and restarts[0]["exit"] == -signal.SIGKILL
    # The same samples as the undisturbed run: seeds are the sample's, not the replica's or the attempt's.
    _, calm = undisturbed
    assert _samples(run_dir)[:2] == _samples(calm)
    same = ("tokens_scored", "reward_mean", "grad_norm", "max_abs_logprob_diff", "weight_versions", "policy_version")
    assert [{k: r.get(k) for k in same} for r in recs[:2]] == [{k: r.get(k) for k in same} for r in records(calm)]


def test_a_replica_that_dies_past_the_bound_ends_the_run(tmp_path: Path) -> None:
    """Disk weight sync, rollout.max_restarts=1: kill -9 of replica 1 once step 0 is recorded; it is
    started again from the checkpoint of the version the others serve, and the steps go on, exact. A
    second kill -9 of it is past the bound: exit 4 within seconds, naming it and the key; completed
    steps on disk; no process of the job left (every child's process group is empty)."""
    proc, run_dir = start_job(tmp_path, "rollout.replicas=2", "rollout.max_restarts=1", "experiment.steps=50")
    wait_for(lambda: len(records(run_dir)) >= 1, 300, "the first step")
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == {"rollout-0", "rollout-1", "rollout-router", "trainer"}
    os.kill(pids["rollout-1"], signal.SIGKILL)
    wait_for(lambda: json.loads((run_dir / "pids.json").read_text())["rollout-1"] != pids["rollout-1"], 120, "it")
    done = len(records(run_dir))
    wait_for(lambda: len(records(run_dir)) > done + 1, 120, "a step with the replacement")
    replaced = json.loads((run_dir / "pids.json").read_text())
    os.kill(replaced["rollout-1"], signal.SIGKILL)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30
    assert "rollout 1 died (exit -9); starting it again at weight version step_" in err
    assert proc.returncode == 4 and "after 1 replacement(s)" in err and "rollout.max_restarts=1" in err, err[-3000:]
    recs = records(run_dir)
    assert summary(run_dir)["steps_completed"] == len(recs) >= done + 2
    assert all(r["mismatched_tokens"] == 0 and r["weight_versions"] == {f"step_{r['step']}" if r["step"] else
               "default": r["tokens_scored"]} for r in recs)  # fmt: skip
    pids |= {"rollout-1-replacement": replaced["rollout-1"]}
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
