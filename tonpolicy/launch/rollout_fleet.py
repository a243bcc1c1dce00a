"""The rollout side of a job: its servers (one, or a fleet's replicas) and a fleet's router, started
from the launch plan's commands, awaited until healthy, and a member that died started again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tonpolicy.config.rollout_backends import rollout_backend
from tonpolicy.config.schema import Config
from tonpolicy.config.server_access import API_KEY_ENV
from tonpolicy.files import write_json_atomic
from tonpolicy.launch.plan import API_KEY_PLACEHOLDER, router_argv
from tonpolicy.launch.procs import Child, ProcessGroup, wait_until
from tonpolicy.loop.exit_codes import EXIT_CHILD_FAILED, EXIT_SERVER_UNHEALTHY, STATUS_FILE
from tonpolicy.ports import free_port, port_is_free

log = logging.getLogger(__name__)


class JobFailed(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def health_ok(url: str, timeout_s: float = 2.0) -> bool:
    from tonpolicy.rollout.client import RolloutClient, RolloutError

    try:
        return RolloutClient(url, timeout_s=timeout_s).health(timeout_s)
    except (RolloutError, OSError):
        return False


def with_flags(command: list[str], values: dict[str, Any], python: str | None = None) -> list[str]:
    """A rendered command with the values of existing flags replaced (and its interpreter, if given).
    A flag the command lacks is an error: the launcher never runs something the plan does not show."""
    argv = list(command)
    if python is not None:
        argv[0] = python
    for flag, value in values.items():
        if flag not in argv:
            raise ValueError(f"rendered command has no {flag}: {' '.join(command)}")
        argv[argv.index(flag) + 1] = str(value)
    return argv


@dataclass
class Fleet:
    """The rollout side of a job: its servers (one, or a fleet's replicas) and, for a fleet, the router
    in front of them. `url` is what the trainer generates through (the router's, or the one server's)."""

    servers: list[Child]
    server_urls: list[str]
    router: Child | None
    url: str
    checkpoint: Path | None = None  # the weights the servers started from ("default")
    restarts: int = 0  # members replaced so far (rollout.max_restarts bounds them)

    def watched(self) -> list[tuple[Child, str]]:
        """Every process whose death or silence ends the job, with its health url."""
        pairs = list(zip(self.servers, self.server_urls, strict=True))
        return pairs + ([(self.router, self.url)] if self.router is not None else [])


def _start_server(
    cfg: Config, run_dir: Path, template: list[str], env: dict[str, str], ckpt: Path, procs: ProcessGroup, name: str
) -> tuple[Child, Path]:
    """Start one rollout server from its rendered command (`name`: its log and port file, which holds
    the port it bound once it listens)."""
    host = cfg.rollout.host
    # One server: rollout.port (0: free). A fleet's replicas: free ports (rollout.port is the router's).
    port = cfg.rollout.port if name == "rollout" else 0
    port_file = run_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    # The plan's command, with only what is decided at launch filled in (interpreter, port, weights).
    if rollout_backend(cfg.rollout.backend).reports_port:
        argv = with_flags(template, {"--port": port, "--model-path": ckpt}, python=sys.executable)
        argv += ["--port-file", str(port_file)]  # the server reports the free port it bound
    else:
        port = port or free_port(host)
        argv = with_flags(template, {"--port": port, "--model-path": ckpt})
        # The key goes in at exec (launch_plan.json and launch.sh show the placeholder only).
        argv = [os.environ[API_KEY_ENV] if a == API_KEY_PLACEHOLDER else a for a in argv]
        port_file.write_text(str(port))
    server = procs.start(name, argv, run_dir / "logs" / f"{name}.log", env=env)
    return server, port_file


def _await_healthy(cfg: Config, child: Child, port_file: Path | None, port: int = 0) -> str:
    """The url of a started server (`port_file`: where it reports its port; None: it binds `port`)
    once it answers /health; JobFailed if it exits or stays silent for rollout.health_timeout_s."""
    what = "rollout server" if child.name == "rollout" else child.name.replace("-", " ")
    if port_file is not None:
        if not wait_until(lambda: port_file.exists() and port_file.read_text().strip() != "", 60, alive=child):
            raise JobFailed(EXIT_SERVER_UNHEALTHY, f"{what} did not report a port\n{child.tail()}")
        port = int(port_file.read_text().strip())
    url = f"http://{cfg.rollout.host}:{port}"
    if not wait_until(lambda: health_ok(url), cfg.rollout.health_timeout_s, alive=child):
        state = "exited" if not child.alive() else f"not healthy after {cfg.rollout.health_timeout_s:.0f}s"
        raise JobFailed(EXIT_SERVER_UNHEALTHY, f"{what} {state} (rollout.health_timeout_s); log tail:\n{child.tail()}")
    return url


def start_rollout(
    cfg: Config, run_dir: Path, plan: dict[str, Any], ckpt: Path, procs: ProcessGroup
) -> list[tuple[Child, Path]]:
    """Start the rollout server, or a fleet's replicas (all at once: each loads its weights at the same
    time); `await_rollout` waits for them. Each with the file its port is in."""
    host, port = cfg.rollout.host, cfg.rollout.port
    if port and not port_is_free(host, port):
        raise JobFailed(
            EXIT_SERVER_UNHEALTHY,
            f"rollout.port={port}: port already in use on {host}; pick another or use 0 (a free port)",
        )
    (run_dir / STATUS_FILE).unlink(missing_ok=True)  # a verdict from an earlier run in this folder
    r = plan["rollout"]
    env = {**plan["environment"], **r.get("environment", {})}
    if "command" in r:
        return [_start_server(cfg, run_dir, r["command"], env, ckpt, procs, "rollout")]
    # A fleet: replicas on free ports (rollout.port, if set, is the router's: the trainer's one address).
    return [
        _start_server(cfg, run_dir, template, env, ckpt, procs, f"rollout-{i}")
        for i, template in enumerate(r["replica_commands"])
    ]


def await_rollout(
    cfg: Config, plan: dict[str, Any], started: list[tuple[Child, Path]], procs: ProcessGroup, run_dir: Path
) -> Fleet:
    """The started servers once healthy; a fleet's router started in front of them and healthy too."""
    urls = [_await_healthy(cfg, child, port_file) for child, port_file in started]
    if "command" in plan["rollout"]:
        return Fleet([started[0][0]], urls, None, urls[0])
    host, port = cfg.rollout.host, cfg.rollout.port
    router_port = port or free_port(host)
    argv = router_argv(cfg, urls, router_port)
    argv = with_flags(argv, {"--prometheus-port": free_port(host)}, python=sys.executable)
    argv = [os.environ[API_KEY_ENV] if a == API_KEY_PLACEHOLDER else a for a in argv]
    router = procs.start("rollout-router", argv, run_dir / "logs" / "rollout-router.log", env=plan["environment"])
    url = _await_healthy(cfg, router, None, router_port)
    return Fleet([c for c, _ in started], urls, router, url)


def end_member(child: Child, grace_s: float = 5.0) -> None:
    """End a member that stopped answering: its whole process group (SIGKILL: a stopped process takes
    no SIGTERM), waited for, so its port and memory are free for a replacement."""
    try:
        os.killpg(child.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        child.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def replace_member(
    cfg: Config, run_dir: Path, rollout: Fleet, dead: Child, procs: ProcessGroup | None, cause: str | None = None
) -> Child:
    """A fleet member that died (or, `cause`, was ended for it), started again at its url (the router's
    list of workers stands; the trainer's client keeps its urls). A replica under disk sync starts from
    the weights the others serve, under their version, so no sample can reach it at other weights; under
    distributed sync from the initial weights, under UNSYNCED_VERSION until the trainer sends it the
    current ones over a new weight-update group (tonpolicy.rollout.fleet). JobFailed (exit 4) for one
    server, past rollout.max_restarts, or where the weights to start from are not on disk."""
    what = "rollout server" if dead.name == "rollout" else dead.name.replace("-", " ")
    died = f"{what} {cause or 'died'} (exit {dead.proc.returncode})"
    if procs is None or rollout.router is None:
        raise JobFailed(EXIT_CHILD_FAILED, f"{died}; log tail:\n{dead.tail()}")
    if rollout.restarts >= cfg.rollout.max_restarts:
        raise JobFailed(
            EXIT_CHILD_FAILED,
            f"{died}, after {rollout.restarts} replacement(s) this run "
            f"(rollout.max_restarts={cfg.rollout.max_restarts}); log tail:\n{dead.tail()}",
        )
    version: str | None = None
    how = ""
    if dead is rollout.router:
        argv = dead.argv
        port = int(argv[argv.index("--port") + 1])
    else:
        from tonpolicy.rollout.client import RolloutClient, RolloutError
        from tonpolicy.rollout.fleet import UNSYNCED_VERSION

        i = rollout.servers.index(dead)
        url = rollout.server_urls[i]
        other = next(u for j, u in enumerate(rollout.server_urls) if j != i)
        try:
            served = version = str(RolloutClient(other, timeout_s=10.0).model_info()["weight_version"])
        except (RolloutError, KeyError, ValueError) as e:
            raise JobFailed(EXIT_CHILD_FAILED, f"{died}; the weight version to replace it at is unknown: {e}") from e
        weights = rollout.checkpoint if version == "default" else run_dir / "checkpoints" / version
        if cfg.rollout.weight_sync != "disk" and version != "default":
            # Only the initial weights are on disk: the trainer sends it the current ones.
            weights, version = rollout.checkpoint, UNSYNCED_VERSION
            how = f" from the initial weights; the trainer sends it weight version {served}"
        if weights is None or not weights.is_dir():
            raise JobFailed(
                EXIT_CHILD_FAILED, f"{died}; the weights of version {version!r} are not on disk ({weights})"
            )
        port = int(url.rsplit(":", 1)[1])
        flags: dict[str, Any] = {"--port": port, "--model-path": weights}
        argv = dead.argv if "--weight-version" in dead.argv else [*dead.argv, "--weight-version", version]
        argv = with_flags(argv, {**flags, "--weight-version": version})
        how = how or f" at weight version {version}"
    log.warning(f"tonpolicy: {died}; starting it again{how}")
    fresh = procs.start(dead.name, argv, dead.log_path, env=dead.env)
    rollout.restarts += 1
    from tonpolicy.rollout.fleet import RESTARTS_FILE

    # Logged as it starts: a step held up by the loss records it (the trainer reads this file).
    event = {"member": dead.name, "exit": dead.proc.returncode, "weight_version": version, "time": time.time()}
    with open(run_dir / RESTARTS_FILE, "a") as f:
        f.write(json.dumps(event) + "\n")
    _await_healthy(cfg, fresh, None, port)
    if dead is rollout.router:
        rollout.router = fresh
    else:
        rollout.servers[rollout.servers.index(dead)] = fresh
    write_json_atomic(run_dir / "pids.json", {c.name: c.proc.pid for c in procs.children if c.alive()})
    return fresh
