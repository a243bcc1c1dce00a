"""A fleet that survives a member, without a job: the launcher starts a dead replica again at its url from
the weights (and under the version) the others serve, and a dead router from its own command, logging
each; past rollout.max_restarts, or where the weights are not on disk, a death ends the job (exit 4).
The trainer's fleet client re-sends a failed sample once the fleet is whole again, with the same rid.
Stand-in servers (a few lines of HTTP) play the replicas and the router."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.e2e_common import pid_alive

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.job import supervise
from tonpolicy.launch.procs import ProcessGroup
from tonpolicy.launch.rollout_fleet import Fleet, JobFailed
from tonpolicy.loop.exit_codes import EXIT_OK, STATUS_FILE
from tonpolicy.ports import free_port
from tonpolicy.rollout.client import RolloutError
from tonpolicy.rollout.fleet import RESTARTS_FILE, UNSYNCED_VERSION, FleetClient, fleet_events

# A stand-in server: binds --port, answers /health and /get_model_info (its --weight-version, or the
# content of --version-file, and --model-path); /generate fails while the file named by --fail-while
# exists, and answers under that version.
STAND_IN = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
class H(BaseHTTPRequestHandler):
    def _send(self, status, body):
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
    def version(self):
        if "--version-file" in args:
            with open(args["--version-file"]) as f:
                return f.read()
        return args.get("--weight-version", "default")
    def do_GET(self):
        info = {"weight_version": self.version(), "model_path": args.get("--model-path")}
        self._send(200, info if self.path == "/get_model_info" else {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(args["--log"], "a") as f:
            f.write(json.dumps(body) + "\\n")
        if os.path.exists(args.get("--fail-while", "/nonexistent")):
            self._send(500, {"error": {"message": "a replica is gone"}})
        else:
            meta = {"output_token_logprobs": [[-0.5, 4, None]], "weight_version": self.version()}
            sample = {"output_ids": [4], "meta_info": meta}
            self._send(200, [sample])
    def log_message(self, *a):
        pass
ThreadingHTTPServer.allow_reuse_address = True
ThreadingHTTPServer(("127.0.0.1", int(args["--port"])), H).serve_forever()
"""


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, ProcessGroup]]:
    """Two stand-in replicas serving `step_1` and a stand-in router, started as the launcher starts
    children; the disk weights of step_1 in the run directory."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    procs = ProcessGroup()
    members, urls = [], []
    for name in ("rollout-0", "rollout-1", "rollout-router"):
        port = free_port()
        argv = [sys.executable, str(script), "--port", str(port), "--model-path", str(tmp_path / "init")]
        argv += ["--log", str(tmp_path / f"{name}.requests")]
        argv += ["--weight-version", "step_1"] if name != "rollout-router" else []
        members.append(procs.start(name, argv, tmp_path / "logs" / f"{name}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    client = FleetClient(urls[2], urls[:2], timeout_s=5)
    client.recover_s = 30
    assert client._wait(client.whole), "stand-ins did not start"
    yield Fleet(members[:2], urls[:2], members[2], urls[2], checkpoint=tmp_path / "init"), procs
    procs.stop_all()


def _supervise(cfg_args: list[str], run_dir: Path, rollout: Fleet, procs: ProcessGroup) -> dict:
    """supervise() in a thread over a trainer that exits (with an ok verdict) once `done` exists."""
    wait = f"import os, time\nwhile not os.path.exists({str(run_dir / 'done')!r}): time.sleep(0.1)"
    trainer = procs.start("trainer", [sys.executable, "-c", wait], run_dir / "logs" / "trainer.log")
    (run_dir / STATUS_FILE).write_text(json.dumps({"code": 0, "message": "ok"}))
    cfg = compose_config(["rollout.replicas=2", "rollout.health_timeout_s=30", *cfg_args])
    out: dict = {}

    def run() -> None:
        try:
            out["code"] = supervise(cfg, run_dir, rollout, trainer, procs)
        except JobFailed as e:
            out["failed"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _restarts(run_dir: Path, n: int) -> list[dict]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        path = run_dir / RESTARTS_FILE
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} restarts logged")


def _replaced(run_dir: Path, name: str, old_pid: int) -> None:
    """Wait until the launcher has swapped the member in (pids.json names the new process)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = run_dir / "pids.json"
        if pids.exists() and json.loads(pids.read_text()).get(name, old_pid) != old_pid:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} was not replaced")


def test_a_dead_replica_and_a_dead_router_are_started_again(tmp_path: Path, fleet) -> None:
    rollout, procs = fleet
    old = rollout.servers[1].proc.pid
    job = _supervise([], tmp_path, rollout, procs)
    os.kill(old, signal.SIGKILL)
    (replica,) = _restarts(tmp_path, 1)
    _replaced(tmp_path, "rollout-1", old)
    assert replica["member"] == "rollout-1" and replica["weight_version"] == "step_1"
    fresh = rollout.servers[1]
    assert fresh.proc.pid != old and fresh.alive()
    # at its url, from the weights the others serve, under their version
    argv = fresh.argv
    assert argv[argv.index("--port") + 1] == rollout.server_urls[1].rsplit(":", 1)[1]
    assert argv[argv.index("--model-path") + 1] == str(tmp_path / "checkpoints" / "step_1")
    assert argv[argv.index("--weight-version") + 1] == "step_1"
    old_router = rollout.router.proc.pid
    os.kill(old_router, signal.SIGKILL)
    assert _restarts(tmp_path, 2)[1]["member"] == "rollout-router"
    _replaced(tmp_path, "rollout-router", old_router)
    assert json.loads((tmp_path / "pids.json").read_text())["rollout-1"] == fresh.proc.pid
    client = FleetClient(rollout.url, rollout.server_urls, timeout_s=5, run_dir=tmp_path)
    assert client.whole() and client.take_events() == {"rollout_restarts": 2, "requests_resent": 0}
    assert client.take_events()["rollout_restarts"] == 0  # taken once
    (tmp_path / "done").touch()
    job["thread"].join(30)
    assert job.get("code") == EXIT_OK, job


def test_a_member_that_keeps_dying_ends_the_job_past_the_bound(tmp_path: Path, fleet) -> None:
    rollout, procs = fleet
    job = _supervise(["rollout.max_restarts=1"], tmp_path, rollout, procs)
    old = rollout.servers[0].proc.pid
    os.kill(old, signal.SIGKILL)
    _restarts(tmp_path, 1)
    _replaced(tmp_path, "rollout-0", old)
    os.kill(rollout.servers[0].proc.pid, signal.SIGKILL)
    job["thread"].join(30)
    assert "rollout 0 died" in str(job["failed"]) and "after 1 replacement(s)" in str(job["failed"])
    assert "rollout.max_restarts=1" in str(job["failed"]) and job["failed"].code == 4
    (tmp_path / "done").touch()


def test_a_replica_is_not_replaced_where_its_weights_cannot_be_had(tmp_path: Path, fleet) -> None:
    """Disk sync, and the checkpoint of the version the others serve is gone: exit 4, saying so."""
    rollout, procs = fleet
    (tmp_path / "checkpoints" / "step_1").rmdir()
    job = _supervise([], tmp_path, rollout, procs)
    os.kill(rollout.servers[1].proc.pid, signal.SIGKILL)
    job["thread"].join(30)
    assert "the weights of version 'step_1' are not on disk" in str(job["failed"]) and job["failed"].code == 4
    assert not (tmp_path / RESTARTS_FILE).exists()
    (tmp_path / "done").touch()


def test_under_distributed_sync_a_hung_replica_is_ended_and_started_from_the_initial_weights(
    tmp_path: Path, fleet
) -> None:
    """A replica that stops answering (SIGSTOP) is a dead one: its process group is ended and it is
    started again. Under distributed sync only the initial weights are on disk: it starts from them,
    under the unsynced version, until the trainer sends it the fleet's (no sample of it can pass)."""
    rollout, procs = fleet
    (tmp_path / "init").mkdir()
    old = rollout.servers[1].proc.pid
    job = _supervise(["rollout.weight_sync=distributed", "rollout.liveness_timeout_s=2"], tmp_path, rollout, procs)
    os.kill(old, signal.SIGSTOP)
    (replica,) = _restarts(tmp_path, 1)
    _replaced(tmp_path, "rollout-1", old)
    assert replica["member"] == "rollout-1" and replica["weight_version"] == UNSYNCED_VERSION
    assert replica["exit"] == -signal.SIGKILL and not pid_alive(old)  # ended, not left stopped
    argv = rollout.servers[1].argv
    assert argv[argv.index("--model-path") + 1] == str(tmp_path / "init")
    assert argv[argv.index("--weight-version") + 1] == UNSYNCED_VERSION
    client = FleetClient(rollout.url, rollout.server_urls, timeout_s=5, run_dir=tmp_path)
    assert client.replica_restarts() == 1 and not client.whole()  # until the trainer has sent the weights
    (tmp_path / "done").touch()
    job["thread"].join(30)
    assert job.get("code") == EXIT_OK, job


def test_a_failed_sample_is_re_sent_with_its_rid_once_the_fleet_is_whole(tmp_path: Path, fleet) -> None:
    """The router fails every request while `gone` exists (a replica lost, not yet replaced); the fleet
    client waits until the fleet is whole, then re-sends the same request. Control: without recover_s
    the failure ends the step."""
    rollout, procs = fleet
    router = rollout.router
    gone = tmp_path / "gone"
    argv = [*router.argv, "--fail-while", str(gone)]
    router.proc.kill()
    router.proc.wait()
    rollout.router = procs.start("rollout-router", argv, router.log_path)
    client = FleetClient(rollout.url, rollout.server_urls, timeout_s=5, retries=0, run_dir=tmp_path)
    assert client._wait(client.whole) is False  # recover_s 0: gives up at once
    client.recover_s = 30
    assert client._wait(client.whole)
    gone.touch()
    with pytest.raises(RolloutError, match="HTTP 500"):
        FleetClient(rollout.url, rollout.server_urls, timeout_s=5, retries=0).generate([[1, 2]], {"sampling_seed": 3})
    served = client.whole
    client.whole = lambda: not gone.exists() and served()  # the fleet is whole once the replica is back
    threading.Timer(1.0, gone.unlink).start()
    out = client.generate([[1, 2], [1, 3]], [{"sampling_seed": 3}, {"sampling_seed": 4}])
    assert [o["output_ids"] for o in out] == [[4], [4]]
    bodies = [json.loads(line) for line in (tmp_path / "rollout-router.requests").read_text().splitlines()]
    first = [b for b in bodies if b["input_ids"] == [[1, 3]]]
    assert len(first) == 2 and first[0] == first[1]  # re-sent: the same rid and seeds
    assert fleet_events(client) == {"rollout_restarts": 0, "requests_resent": 2}


def test_a_sample_an_unsynced_replacement_answered_is_re_sent_once_it_has_the_weights(tmp_path: Path, fleet) -> None:
    """Distributed sync: replica 1's replacement serves the initial weights under the unsynced version,
    and the router hands it samples. The fleet client does not keep them: once every member answers, it
    calls `rejoin` (the weight sync's: a new group, the current weights sent), then re-sends the same
    requests, now answered at the fleet's version. Control: without `rejoin` the fleet is never whole
    again and the step fails, naming the cause."""
    rollout, procs = fleet
    version = tmp_path / "version"
    version.write_text(UNSYNCED_VERSION)
    for k, member in ((1, rollout.servers[1]), (None, rollout.router)):  # the router answers as replica 1
        member.proc.kill()
        member.proc.wait()
        fresh = procs.start(member.name, [*member.argv, "--version-file", str(version)], member.log_path)
        if k is None:
            rollout.router = fresh
        else:
            rollout.servers[k] = fresh
    client = FleetClient(rollout.url, rollout.server_urls, timeout_s=5, retries=0, recover_s=3)
    assert client._wait(lambda: all(c.health(1.0) for c in (client.router, *client.replicas)))
    with pytest.raises(RolloutError, match="before it had the fleet's weights; the fleet was not whole again"):
        client.generate([[1, 2]], {"sampling_seed": 3})
    rejoined = []
    client.rejoin = lambda: (rejoined.append(1), version.write_text("step_1"))  # what the push does
    out = client.generate([[1, 2], [1, 3]], [{"sampling_seed": 3}, {"sampling_seed": 4}])
    assert [o["weight_version"] for o in out] == ["step_1", "step_1"] and rejoined == [1]
    assert client.take_events()["requests_resent"] >= 2
    bodies = [json.loads(line) for line in (tmp_path / "rollout-router.requests").read_text().splitlines()]
    sent = [b for b in bodies if b["input_ids"] == [[1, 3]]]
    assert len(sent) == 2 and sent[0] == sent[1]  # re-sent: the same rid and seeds


def test_max_restarts_is_a_validated_key() -> None:
    from tonpolicy.config.fleet_rules import check_fleet

    assert compose_config(["mode=plan"]).rollout.max_restarts == 2
    for value, errors in ((-1, 1), (0, 0), (100, 0), (101, 1)):
        found: list[tuple[str, str]] = []
        check_fleet(
            compose_config(["mode=plan", f"rollout.max_restarts={value}"]),
            lambda k, r, found=found: found.append((k, r)),
        )
        assert [k for k, _ in found] == ["rollout.max_restarts"] * errors
        assert all("must be an integer in [0, 100]" in r for _, r in found)
