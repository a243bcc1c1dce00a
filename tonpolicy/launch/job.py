"""One job, end to end: rollout server + trainer ranks, supervised until done or failed.

The orchestrator owns every child process. Whatever ends the job (success, a failed parity gate,
a dead rank or server, Ctrl-C) it stops all children, writes summary.json from the step records
already on disk, prints the per-step table and where the logs are, and returns the exit code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tonpolicy.config.names import layout_label
from tonpolicy.config.schema import Config
from tonpolicy.config.sizes import world_size
from tonpolicy.contract.identity import identity
from tonpolicy.files import write_json_atomic
from tonpolicy.launch.curves import reward_curve
from tonpolicy.launch.init_checkpoint import write_init_checkpoint
from tonpolicy.launch.procs import Child, ProcessGroup
from tonpolicy.launch.records import read_jsonl, step_table
from tonpolicy.launch.rollout_fleet import (
    Fleet,
    JobFailed,
    await_rollout,
    end_member,
    health_ok,
    replace_member,
    start_rollout,
    with_flags,
)
from tonpolicy.launch.run_report import startup_line, where_lines
from tonpolicy.launch.sglang_env import trainer_python
from tonpolicy.launch.trainer_main import ROLLOUT_ADDRESS_FILE
from tonpolicy.loop.exit_codes import (
    EXIT_CHILD_FAILED,
    EXIT_GATE_FAILED,
    EXIT_HANDSHAKE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    STATUS_FILE,
)
from tonpolicy.ports import free_port
from tonpolicy.version import build_info

log = logging.getLogger(__name__)


def prepare_checkpoint(cfg: Config, run_dir: Path) -> Path:
    """The HF checkpoint both engines start from: the user's, or a seeded random init."""
    if cfg.model.checkpoint:
        return Path(cfg.model.checkpoint)
    return write_init_checkpoint(cfg, run_dir / "checkpoints" / "init")


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
            if health_ok(self.url, min(2.0, self.timeout_s)):
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


def supervise(cfg: Config, run_dir: Path, rollout: Fleet, trainer: Child, procs: ProcessGroup | None = None) -> int:
    """Wait for the trainer, printing each step as its record lands. A fleet member that dies, or stops
    answering /health for rollout.liveness_timeout_s (hung, stopped: it is ended first), is started
    again (`replace_member`, with `procs`); one server that does either, or a member that cannot be
    replaced, ends the job at once."""
    tail = _Tail(run_dir / "metrics.jsonl")
    watched = [(child, _Liveness(url, cfg.rollout.liveness_timeout_s)) for child, url in rollout.watched()]
    while True:
        for record in tail.new_records():
            log.info(_progress(record, cfg.experiment.steps))
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
                limit = cfg.rollout.liveness_timeout_s
                hung = f"stopped answering /health for {silent:.0f}s (rollout.liveness_timeout_s={limit:g})"
                if procs is None or rollout.router is None:
                    raise JobFailed(EXIT_CHILD_FAILED, f"{what} {hung}; log tail:\n{server.tail()}")
                end_member(server)  # a hung member is a dead one: its process group ended, then replaced
                fresh = replace_member(cfg, run_dir, rollout, server, procs, cause=f"{hung}, ended")
                watched[k] = (fresh, _Liveness(liveness.url, cfg.rollout.liveness_timeout_s))
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
        "task": prompt_source(cfg),
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
            f"{prompt_source(cfg)}, {cfg.contract.name} {layout_label(cfg.parallel)}: reward and parity",
        )
        print(step_table(records))  # the job's result, on stdout whatever the log level
    return summary


def prompt_source(cfg: Config) -> str:
    """What the run's prompts come from: the data files when the user gave them, else the built-in task."""
    if cfg.data.train_files:
        return "data " + ", ".join(Path(f).name for f in cfg.data.train_files)
    return cfg.task.name


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
            log.info(startup_line(cfg, run_dir, len(started), world_size(cfg)))
            rollout = await_rollout(cfg, plan, started, procs, run_dir)
            rollout.checkpoint = ckpt
            write_json_atomic(address, {"url": rollout.url, "replica_urls": rollout.server_urls})
            if rollout.router is None:
                log.info(f"rollout server ({cfg.rollout.backend}) healthy at {rollout.url}")
            else:
                log.info(
                    f"{len(rollout.servers)} rollout servers ({cfg.rollout.backend}) healthy at "
                    f"{', '.join(rollout.server_urls)}, behind sglang-router at {rollout.url}"
                )
            write_json_atomic(run_dir / "pids.json", {c.name: c.proc.pid for c in procs.children})
            code = supervise(cfg, run_dir, rollout, trainer, procs)
            served = requests_served(rollout)
        status = "ok"
    except JobFailed as exc:
        code = exc.code
        status = {EXIT_GATE_FAILED: "gate_failed", EXIT_HANDSHAKE: "handshake_refused"}.get(code, "failed")
        log.error(f"tonpolicy: {exc}")
    except KeyboardInterrupt:
        status, code = "interrupted", EXIT_INTERRUPTED
        log.warning("tonpolicy: interrupted; stopping every child process")
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    summary = summarize(cfg, run_dir, status, time.monotonic() - t0, served)
    # The verdict and where the results are: the job's result, shown whatever the log level.
    print(
        json.dumps({k: summary[k] for k in ("status", "steps_completed", "mismatched_tokens", "wall_s")}),
        file=sys.stderr,
    )
    for line in where_lines(run_dir):  # on success too: where the results are
        print(line, file=sys.stderr)
    if code:
        log.error(f"tonpolicy: job {status} (exit {code}); logs in {run_dir / 'logs'}")
    return code
