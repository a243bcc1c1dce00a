"""Child processes of a job: each in its own process group with a log file, ended as a group.

Every child is tracked so that any failure path (a dead rank, a dead server, Ctrl-C) ends all of
them within seconds and says where their logs are.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class ProcessGroup:
    children: list[Child] = field(default_factory=list)
    # With a registry file, a watchdog process (tonpolicy.launch.watchdog) ends every child's process
    # group if this process dies without calling stop_all (kill -9).
    registry: Path | None = None
    watchdog: subprocess.Popen | None = None

    def start_watchdog(self, registry: Path) -> None:
        registry.parent.mkdir(parents=True, exist_ok=True)
        registry.write_text("")
        self.registry = registry
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "tonpolicy.launch.watchdog", str(registry)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def start(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Child:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")  # noqa: SIM115 (the child owns it until it exits)
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        if self.registry is not None:
            with open(self.registry, "a") as f:
                f.write(f"{proc.pid}\n")
                f.flush()
                os.fsync(f.fileno())
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace_s`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for c in self.children:
                if c.alive():
                    try:
                        os.killpg(c.proc.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace_s
            while any(c.alive() for c in self.children) and time.monotonic() < deadline:
                time.sleep(0.05)
        for c in self.children:
            try:
                c.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.terminate()  # nothing left to watch
            self.watchdog.wait(timeout=5)
        if self.registry is not None:
            self.registry.unlink(missing_ok=True)


def wait_until(pred: Callable[[], bool], timeout_s: float, *, alive: Child | None = None, poll_s: float = 0.2) -> bool:
    """Poll `pred` until true; give up at the timeout or as soon as `alive` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        if alive is not None and not alive.alive():
            return False
        time.sleep(poll_s)
    return False
