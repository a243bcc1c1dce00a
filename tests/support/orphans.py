"""Signals at random instants of a job: does any process of the run outlive its launcher?

Every process a run starts inherits the launcher's environment, so a marker variable set for the
launcher finds them all in /proc, wherever they were reparented. Used by tests/e2e/test_no_orphans.py
and, with more instants, by experiments/orphan_check.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from support.e2e_common import pid_alive, tonpolicy_argv

MARK = "TONPOLICY_ORPHAN_PROBE"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


def marked(value: str) -> list[int]:
    """Live processes whose environment carries MARK=value (zombies excluded)."""
    needle = f"{MARK}={value}".encode()
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in env.read_bytes().split(b"\0"):
                pid = int(env.parent.name)
                if pid_alive(pid):
                    found.append(pid)
        except (OSError, ValueError):
            continue
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


@dataclass
class Outcome:
    signal: str
    after_s: float
    survivors: list[str]  # command lines of processes alive 10 s after the launcher ended
    unreadable: list[str]  # record files that did not parse

    @property
    def clean(self) -> bool:
        return not self.survivors and not self.unreadable


def _unreadable(run_dir: Path) -> list[str]:
    bad = []
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = run_dir / name
        if path.exists():
            for n, line in enumerate(path.read_text().splitlines()):
                try:
                    json.loads(line)
                except ValueError:
                    bad.append(f"{name}:{n + 1}")
    for name in ("summary.json", "plan.json"):
        path = run_dir / name
        if path.exists():
            try:
                json.loads(path.read_text())
            except ValueError:
                bad.append(name)
    return bad


def signal_at(workdir: Path, sig: signal.Signals, after_s: float, *overrides: str) -> Outcome:
    """Start a job, send `sig` to its launcher `after_s` seconds later, and report what survives."""
    workdir.mkdir(parents=True, exist_ok=True)
    value, run_dir = uuid.uuid4().hex, workdir / "run"
    proc = subprocess.Popen(
        tonpolicy_argv(run_dir, *overrides),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, MARK: value},
    )
    time.sleep(after_s)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while marked(value) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked(value)
    survivors = [_command(p) for p in left]
    for pid in left:  # leave the machine clean for the next instant
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Outcome(sig.name, round(after_s, 2), survivors, _unreadable(run_dir))


def random_instants(workdir: Path, per_signal: int, horizon_s: float, seed: int, *overrides: str) -> list[Outcome]:
    """`per_signal` instants drawn uniformly in [0, horizon_s) for each of SIGINT, SIGTERM and SIGKILL;
    the three signals of a round run at once."""
    rng = random.Random(seed)
    outcomes = []
    for round_ in range(per_signal):
        jobs = []
        for sig in SIGNALS:
            after = rng.uniform(0.0, horizon_s)
            jobs.append((sig, after, workdir / f"{round_}_{sig.name}"))
        outcomes += _concurrently(jobs, overrides)
    return outcomes


def _concurrently(jobs: list[tuple[signal.Signals, float, Path]], overrides: tuple[str, ...]) -> list[Outcome]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: signal_at(j[2], j[0], j[1], *overrides), jobs))
