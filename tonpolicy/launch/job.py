"""One job, end to end: rollout server + trainer ranks, supervised until done or failed.

The orchestrator owns every child process. Whatever ends the job (success, a failed parity gate,
a dead rank or server, Ctrl-C) it stops all children, writes summary.json from the step records
already on disk, prints the per-step table and where the logs are, and returns the exit code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tonpolicy.config.names import layout_label
from tonpolicy.config.ranges import API_KEY_ENV
from tonpolicy.config.rollout_backends import rollout_backend
from tonpolicy.config.schema import Config
from tonpolicy.config.sizes import world_size
from tonpolicy.contract.identity import identity
from tonpolicy.files import write_json_atomic
from tonpolicy.launch.curves import reward_curve
from tonpolicy.launch.init_checkpoint import write_init_checkpoint
from tonpolicy.launch.plan import API_KEY_PLACEHOLDER, router_argv
from tonpolicy.launch.procs import Child, ProcessGroup, wait_until
from tonpolicy.launch.records import read_jsonl, step_table
from tonpolicy.launch.run_report import startup_line, where_lines
from tonpolicy.launch.sglang_env import trainer_python
from tonpolicy.launch.trainer_main import ROLLOUT_ADDRESS_FILE
from tonpolicy.loop.exit_codes import (
    EXIT_CHILD_FAILED,
    EXIT_GATE_FAILED,
    EXIT_HANDSHAKE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SERVER_UNHEALTHY,
    STATUS_FILE,
)
from tonpolicy.ports import free_port, port_is_free
from tonpolicy.version import build_info


class JobFailed(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def prepare_checkpoint(cfg: Config, run_dir: Path) -> Path:
    """The HF checkpoint both engines start from: the user's, or a seeded random init."""
    if cfg.model.checkpoint:
        return Path(cfg.model.checkpoint)
    return write_init_checkpoint(cfg, run_dir / "checkpoints" / "init")


def _health_ok(url: str, timeout_s: float = 2.0) -> bool:
    from tonpolicy.rollout.client import RolloutClient, RolloutError

    try:
        return RolloutClient(url, timeout_s=timeout_s).health(timeout_s)
    except (RolloutError, OSError):
        return False


# The last exception line a rank printed; torchrun's own ChildFailedError only says that one failed.
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s*")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::.*)?$")


def root_cause(log_path: Path) -> str | None:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    stripped = (_RANK_PREFIX.sub("", ln.strip()) for ln in lines)  # torchrun prefixes "[rank0]: "
    causes = [ln for ln in stripped if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    return causes[-1] if causes else None


class _Liveness:
    """The server must keep answering /health: silent for `timeout_s` means hung or stopped."""

    def __init__(self, url: str, timeout_s: float, every_s: float = 1.0) -> None:
        self.url, self.timeout_s, self.every_s = url, timeout_s, every_s
        self.last_ok = self.last_check = time.monotonic()

    def silent_for(self) -> float:
        now = time.monotonic()
        if now - self.last_check >= self.every_s:
            self.last_check = now
            if _health_ok(self.url, min(2.0, self.timeout_s)):
                self.last_ok = time.monotonic()
        return time.monotonic() - self.last_ok


class _Tail:
    """New complete lines of an append-only JSONL file since the last call (no re-reading)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


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
    if not wait_until(lambda: _health_ok(url), cfg.rollout.health_timeout_s, alive=child):
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


def start_trainer(
    cfg: Config, run_dir: Path, plan: dict[str, Any], url: str, ckpt: Path, procs: ProcessGroup,
) -> Child:  # fmt: skip
    nproc = cfg.trainer.nproc_per_node or world_size(cfg) // cfg.trainer.nnodes
    master_port = cfg.trainer.master_port or free_port()
    # `url`: the rollout's, or @FILE where the launcher writes it (and a fleet's replica urls) when healthy.
    flags: dict[str, Any] = {"--master-port": master_port, "--server-url": url, "--checkpoint": ckpt}
    if cfg.trainer.nnodes > 1:
        flags["--node-rank"] = cfg.trainer.node_rank or 0
    argv = with_flags(plan["trainer_command"], flags, python=trainer_python(cfg))
    env = dict(plan["environment"])
    if plan["device"] == "cpu":
        # The contract kernels are thread-count invariant; this only keeps 2-core machines responsive.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return procs.start("trainer", argv, run_dir / "logs" / "trainer.log", env=env)


def _progress(record: dict[str, Any], steps: int) -> str:
    return (
        f"[step {record['step'] + 1}/{steps}] tokens={record['tokens_scored']} "
        f"mismatched={record['mismatched_tokens']} max|Δlogp|={record['max_abs_logprob_diff']:.3e} "
        + (f"routing_agreement={record['routing_agreement']} " if "routing_agreement" in record else "")
        + f"reward={record.get('reward_mean', 0.0):.3f} grad_norm={record.get('grad_norm', float('nan')):.5g} "
        f"(rollout {record.get('rollout_s', 0.0):.1f}s, step {record.get('step_s', 0.0):.1f}s)"
    )


def replace_member(cfg: Config, run_dir: Path, rollout: Fleet, dead: Child, procs: ProcessGroup | None) -> Child:
    """A fleet member that died, started again at its url (the router's list of workers stands; the
    trainer's client keeps its urls): a replica from the weights the others serve, under their version,
    so no sample can reach it at other weights. JobFailed (exit 4) for one server, past
    rollout.max_restarts, or where the current weights are not on disk."""
    what = "rollout server" if dead.name == "rollout" else dead.name.replace("-", " ")
    died = f"{what} died (exit {dead.proc.returncode})"
    if procs is None or rollout.router is None:
        raise JobFailed(EXIT_CHILD_FAILED, f"{died}; log tail:\n{dead.tail()}")
    if rollout.restarts >= cfg.rollout.max_restarts:
        raise JobFailed(
            EXIT_CHILD_FAILED,
            f"{died}, after {rollout.restarts} replacement(s) this run "
            f"(rollout.max_restarts={cfg.rollout.max_restarts}); log tail:\n{dead.tail()}",
        )
    version: str | None = None
    if dead is rollout.router:
        argv = dead.argv
        port = int(argv[argv.index("--port") + 1])
    else:
        if cfg.rollout.weight_sync != "disk":
            raise JobFailed(
                EXIT_CHILD_FAILED,
                f"{died}; a replacement cannot join the weight-update group of rollout.weight_sync="
                f"{cfg.rollout.weight_sync} (use rollout.weight_sync=disk for a fleet that replaces replicas); "
                f"log tail:\n{dead.tail()}",
            )
        from tonpolicy.rollout.client import RolloutClient, RolloutError

        i = rollout.servers.index(dead)
        url = rollout.server_urls[i]
        other = next(u for j, u in enumerate(rollout.server_urls) if j != i)
        try:
            version = str(RolloutClient(other, timeout_s=10.0).model_info()["weight_version"])
        except (RolloutError, KeyError, ValueError) as e:
            raise JobFailed(EXIT_CHILD_FAILED, f"{died}; the weight version to replace it at is unknown: {e}") from e
        weights = rollout.checkpoint if version == "default" else run_dir / "checkpoints" / version
        if weights is None or not weights.is_dir():
            raise JobFailed(
                EXIT_CHILD_FAILED, f"{died}; the weights of version {version!r} are not on disk ({weights})"
            )
        port = int(url.rsplit(":", 1)[1])
        flags: dict[str, Any] = {"--port": port, "--model-path": weights}
        argv = dead.argv if "--weight-version" in dead.argv else [*dead.argv, "--weight-version", version]
        argv = with_flags(argv, {**flags, "--weight-version": version})
    print(f"tonpolicy: {died}; starting it again" + (f" at weight version {version}" if version else ""),
          file=sys.stderr, flush=True)  # fmt: skip
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


def supervise(cfg: Config, run_dir: Path, rollout: Fleet, trainer: Child, procs: ProcessGroup | None = None) -> int:
    """Wait for the trainer, printing each step as its record lands. A fleet member that dies is
    started again (`replace_member`, with `procs`); a silent server, or a dead one that cannot be
    replaced, ends the job at once."""
    tail = _Tail(run_dir / "metrics.jsonl")
    watched = [(child, _Liveness(url, cfg.rollout.liveness_timeout_s)) for child, url in rollout.watched()]
    while True:
        for record in tail.new_records():
            print(_progress(record, cfg.experiment.steps), file=sys.stderr, flush=True)
        if not trainer.alive():
            break
        for k, (server, liveness) in enumerate(watched):
            what = "rollout server" if server.name == "rollout" else server.name.replace("-", " ")
            if not server.alive():
                fresh = replace_member(cfg, run_dir, rollout, server, procs)
                watched[k] = (fresh, _Liveness(liveness.url, cfg.rollout.liveness_timeout_s))
                continue
            silent = liveness.silent_for()
            if silent > cfg.rollout.liveness_timeout_s:
                raise JobFailed(
                    EXIT_CHILD_FAILED,
                    f"{what} stopped answering /health for {silent:.0f}s "
                    f"(rollout.liveness_timeout_s={cfg.rollout.liveness_timeout_s:g}); log tail:\n{server.tail()}",
                )
        time.sleep(0.2)
    # The trainer's verdict (ok, gate, handshake) is in its status file; torchrun's exit code only
    # says whether some rank failed, and a rank that died wrote no verdict.
    status_path = run_dir / STATUS_FILE
    if not status_path.exists():
        raise trainer_failed(trainer, with_tail=True)
    status = json.loads(status_path.read_text())
    if status["code"]:
        raise JobFailed(status["code"], status["message"])
    return EXIT_OK


def trainer_failed(trainer: Child, with_tail: bool) -> JobFailed:
    cause = root_cause(trainer.log_path)
    message = f"trainer exited with {trainer.proc.returncode}" + (f": {cause}" if cause else "")
    message += f"\nfull log: {trainer.log_path}" + (f"\nlog tail:\n{trainer.tail(40)}" if with_tail else "")
    return JobFailed(EXIT_CHILD_FAILED, message)


def supervise_worker_node(trainer: Child) -> int:
    """A node other than 0 holds no server and writes no records: its ranks' exit is its verdict
    (a dead peer node makes their next collective fail at once, so they do not wait)."""
    while trainer.alive():
        time.sleep(0.2)
    if trainer.proc.returncode:
        raise trainer_failed(trainer, with_tail=False)
    return EXIT_OK


def requests_served(rollout: Fleet) -> list[int | None] | None:
    """A fleet's requests per replica (the embedded server counts them; None where a server does not)."""
    if rollout.router is None:
        return None
    from tonpolicy.rollout.fleet import FleetClient

    try:
        return FleetClient(rollout.url, rollout.server_urls, timeout_s=5.0).requests_served()
    except Exception:  # noqa: BLE001 - a statistic only
        return None


def summarize(
    cfg: Config, run_dir: Path, status: str, wall_s: float, served: list[int | None] | None = None
) -> dict[str, Any]:
    records = read_jsonl(run_dir / "metrics.jsonl")
    summary = {
        "status": status,
        "contract": cfg.contract.name,
        "contract_identity": identity(cfg.contract).to_dict(),
        "layout": layout_label(cfg.parallel),
        "rollout": f"{cfg.rollout.backend} tp{cfg.parallel.rollout_tp}"
        + (f" x{cfg.rollout.replicas} replicas" if cfg.rollout.replicas > 1 else ""),
        "dtype": cfg.contract.dtype,
        "model": cfg.model.name,
        "steps_completed": len(records),
        "steps_requested": cfg.experiment.steps,
        "tokens_scored": sum(r["tokens_scored"] for r in records),
        "mismatched_tokens": sum(r["mismatched_tokens"] for r in records),
        "max_abs_logprob_diff": max((r["max_abs_logprob_diff"] for r in records), default=0.0),
        "last_grad_norm": next((r["grad_norm"] for r in reversed(records) if "grad_norm" in r), None),
        "task": cfg.task.name,
        "rewards": [r["reward_mean"] for r in records],
        "wall_s": round(wall_s, 2),
        "tonpolicy": build_info(),  # the code that ran: version, git commit, uncommitted changes
    }
    if served is not None:  # a fleet's: requests each replica ran (one per sample, through the router)
        summary["replica_requests"] = served
    agreements = [r["routing_agreement"] for r in records if r.get("routing_agreement") is not None]
    if agreements:  # an MoE run's worst step (dense runs' summaries keep their keys)
        summary["min_routing_agreement"] = min(agreements)
    write_json_atomic(run_dir / "summary.json", summary)
    if records:
        reward_curve(
            records,
            run_dir / "reward_curve.png",
            f"{cfg.task.name}, {cfg.contract.name} {layout_label(cfg.parallel)}: reward and parity",
        )
        print(step_table(records))
    return summary


def run_job(cfg: Config, run_dir: Path, plan: dict[str, Any]) -> int:
    t0 = time.monotonic()
    build_info()  # the checkout as the job starts (remembered), not as it is when the summary is written
    procs = ProcessGroup()
    procs.start_watchdog(run_dir / ".children")  # children die with the launcher, even on kill -9
    # SIGTERM takes the same clean-up path as Ctrl-C. Ctrl-C interrupts even when SIGINT came in ignored
    # (a launcher started in the background by a non-interactive shell inherits SIG_IGN, and then ran
    # to the end on an explicit SIGINT).
    previous = signal.signal(signal.SIGTERM, procs.interrupt)
    previous_int = signal.signal(signal.SIGINT, procs.interrupt)
    status, code = "failed", EXIT_CHILD_FAILED
    served: list[int | None] | None = None
    try:
        ckpt = prepare_checkpoint(cfg, run_dir)
        if cfg.trainer.node_rank:  # a worker node (nodes.place): trainer ranks only; node 0 hosts the server
            trainer = start_trainer(cfg, run_dir, plan, "http://node-0", ckpt, procs)
            write_json_atomic(run_dir / "pids.json", {c.name: c.proc.pid for c in procs.children})
            code = supervise_worker_node(trainer)
        else:
            started = start_rollout(cfg, run_dir, plan, ckpt, procs)
            # The trainer loads (its imports, model and checkpoint) while the rollout starts; it reads the
            # rollout's address from this file, written once every server is healthy.
            address = run_dir / ROLLOUT_ADDRESS_FILE
            address.unlink(missing_ok=True)
            trainer = start_trainer(cfg, run_dir, plan, f"@{address}", ckpt, procs)
            print(startup_line(cfg, run_dir, len(started), world_size(cfg)), file=sys.stderr, flush=True)
            rollout = await_rollout(cfg, plan, started, procs, run_dir)
            rollout.checkpoint = ckpt
            write_json_atomic(address, {"url": rollout.url, "replica_urls": rollout.server_urls})
            if rollout.router is None:
                print(f"rollout server ({cfg.rollout.backend}) healthy at {rollout.url}", file=sys.stderr)
            else:
                print(
                    f"{len(rollout.servers)} rollout servers ({cfg.rollout.backend}) healthy at "
                    f"{', '.join(rollout.server_urls)}, behind sglang-router at {rollout.url}",
                    file=sys.stderr,
                )
            write_json_atomic(run_dir / "pids.json", {c.name: c.proc.pid for c in procs.children})
            code = supervise(cfg, run_dir, rollout, trainer, procs)
            served = requests_served(rollout)
        status = "ok"
    except JobFailed as exc:
        code = exc.code
        status = {EXIT_GATE_FAILED: "gate_failed", EXIT_HANDSHAKE: "handshake_refused"}.get(code, "failed")
        print(f"tonpolicy: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        status, code = "interrupted", EXIT_INTERRUPTED
        print("tonpolicy: interrupted; stopping every child process", file=sys.stderr)
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    summary = summarize(cfg, run_dir, status, time.monotonic() - t0, served)
    print(
        json.dumps({k: summary[k] for k in ("status", "steps_completed", "mismatched_tokens", "wall_s")}),
        file=sys.stderr,
    )
    for line in where_lines(run_dir):  # on success too: where the results are
        print(line, file=sys.stderr)
    if code:
        print(f"tonpolicy: job {status} (exit {code}); logs in {run_dir / 'logs'}", file=sys.stderr)
    return code
