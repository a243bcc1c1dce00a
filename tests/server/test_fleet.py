"""The fleet's parts without a job: the plan's commands, per-token weight versions from SGLang's spans,
the synchronous version check, the fleet client's fan-out (rank offsets, a failing replica), and the
launcher's watch over every replica and the router."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.job import supervise
from tonpolicy.launch.plan import launch_plan, launch_script
from tonpolicy.launch.procs import Child
from tonpolicy.launch.rollout_fleet import Fleet, JobFailed
from tonpolicy.loop.exit_codes import EXIT_CHILD_FAILED
from tonpolicy.loop.weight_sync import DiskWeightSync, PolicyVersionError, policy_version
from tonpolicy.ports import free_port
from tonpolicy.rollout.client import RolloutError
from tonpolicy.rollout.fleet import FleetClient
from tonpolicy.rollout.wire.request import ProtocolError
from tonpolicy.rollout.wire.response import token_weight_versions


def test_plan_renders_every_replica_and_the_router(tmp_path: Path) -> None:
    cfg = compose_config(["mode=plan", "rollout.replicas=3", "rollout.router_policy=cache_aware"])
    plan = launch_plan(cfg, tmp_path)
    r = plan["rollout"]
    assert "command" not in r and len(r["replica_commands"]) == 3
    ports = [c[c.index("--port") + 1] for c in r["replica_commands"]]
    assert ports == ["30001", "30002", "30003"]
    router = r["router_command"]
    assert router[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert router[router.index("--host") + 1] == "127.0.0.1"  # sglang-router's own default is 0.0.0.0
    assert router[router.index("--prometheus-host") + 1] == "127.0.0.1"
    assert router[router.index("--policy") + 1] == "cache_aware" and router[router.index("--port") + 1] == "30000"
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    assert router[router.index("--worker-urls") + 1 :] == urls
    trainer = plan["trainer_command"]
    assert trainer[trainer.index("--server-url") + 1] == "http://127.0.0.1:30000"
    assert trainer[trainer.index("--replica-urls") + 1] == ",".join(urls)
    script = launch_script(plan)
    assert script.count("ROLLOUT_PIDS+=($!)") == 4 and "sglang_router.launch_router" in script


def test_one_server_plan_is_unchanged(tmp_path: Path) -> None:
    plan = launch_plan(compose_config(["mode=plan"]), tmp_path)
    assert "command" in plan["rollout"] and "router_command" not in plan["rollout"]
    assert "--replica-urls" not in plan["trainer_command"]


def test_token_weight_versions_from_spans() -> None:
    spans = [{"version": "step_1", "start": 0, "end": 2}, {"version": "step_2", "start": 2, "end": 5}]
    assert token_weight_versions({"weight_versions": spans, "weight_version": "step_2"}, 5) == (
        ["step_1"] * 2 + ["step_2"] * 3
    )
    assert token_weight_versions({"weight_version": "default"}, 3) == ["default"] * 3  # no spans: one version
    with pytest.raises(ProtocolError, match="do not cover"):
        token_weight_versions({"weight_versions": spans[:1]}, 5)


def test_synchronous_steps_hold_every_token_to_the_last_push() -> None:
    assert [policy_version(v) for v in ("default", "step_3", "mine")] == [0, 3, None]

    class Client:
        def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict:
            return {"success": True}

    sync = DiskWeightSync(Client(), Path("/nonexistent"))
    sync.check_versions([["default", "default"], ["default"]])
    sync.push(0)
    assert sync.version == "step_1"
    sync.check_versions([["step_1"]])
    with pytest.raises(PolicyVersionError, match=r"\{'default': 1\}.*expected every token from 'step_1'"):
        sync.check_versions([["step_1", "default"]])
    # a multi-turn batch: the environment's tokens (mask False) were not sampled and carry no version
    sync.check_versions([["step_1", None, "step_1"]], 0, [torch.tensor([True, False, True])])
    with pytest.raises(PolicyVersionError, match=r"\{None: 1\}"):
        sync.check_versions([["step_1", None, None]], 0, [torch.tensor([True, False, True])])


class _Replica:
    def __init__(self, url: str, fail: bool = False) -> None:
        self.base_url, self.fail, self.calls = url, fail, []

    def init_weights_update_group(self, *args: object) -> dict:
        self.calls.append(args)
        return {"success": True}

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict:
        if self.fail:
            raise RolloutError("/update_weights_from_disk failed (HTTP 400): no such checkpoint")
        self.calls.append((path, weight_version))
        return {"success": True}


def test_fleet_client_gives_each_replica_its_ranks_and_names_a_failing_one() -> None:
    fleet = FleetClient("http://router", ["http://a", "http://b"])
    fleet.replicas = [_Replica("http://a"), _Replica("http://b")]
    # 2 replicas x 2 engine ranks each behind the trainer's rank 0: offsets 1 and 3 of a world of 5
    fleet.init_weights_update_group("127.0.0.1", 1234, 1, 5, "g", "gloo")
    assert [r.calls[0][2] for r in fleet.replicas] == [1, 3] and all(r.calls[0][3] == 5 for r in fleet.replicas)
    fleet.update_weights_from_disk("/ckpt", "step_1")
    assert all(r.calls[-1] == ("/ckpt", "step_1") for r in fleet.replicas)
    fleet.replicas[1].fail = True
    with pytest.raises(RolloutError, match="replica http://b: .*no such checkpoint"):
        fleet.update_weights_from_disk("/ckpt", "step_2")


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _child(tmp_path: Path, name: str, argv: list[str]) -> Child:
    log = tmp_path / f"{name}.log"
    log.write_text(f"{name}'s log\n")
    return Child(name, subprocess.Popen(argv, start_new_session=True), log)


@pytest.mark.parametrize("fault", ["replica_silent", "router_dead"])
def test_supervise_ends_the_job_for_a_silent_replica_or_a_dead_router(tmp_path: Path, fault: str) -> None:
    """The launcher watches every replica and the router as it watches one server: silent past
    rollout.liveness_timeout_s, or exited, is exit 4 (EXIT_CHILD_FAILED) naming which."""
    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    ok_url, silent_url = f"http://127.0.0.1:{healthy.server_address[1]}", f"http://127.0.0.1:{free_port()}"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    children = [_child(tmp_path, n, sleep) for n in ("rollout-0", "rollout-1", "rollout-router", "trainer")]
    *replicas, router, trainer = children
    if fault == "router_dead":
        router.proc.kill()
        router.proc.wait()
    urls = [ok_url, silent_url if fault == "replica_silent" else ok_url]
    fleet = Fleet(replicas, urls, router, ok_url)
    cfg = compose_config(["rollout.replicas=2", "rollout.liveness_timeout_s=1"])
    try:
        with pytest.raises(JobFailed) as failed:
            supervise(cfg, tmp_path, fleet, trainer)
    finally:
        for c in children:
            c.proc.kill()
            c.proc.wait()
        healthy.shutdown()
    assert failed.value.code == EXIT_CHILD_FAILED
    expected = "rollout 1 stopped answering /health" if fault == "replica_silent" else "rollout router died"
    assert expected in str(failed.value)
