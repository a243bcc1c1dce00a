"""Child processes of a job: each in its own process group with a log file, ended as a group.

Every child is tracked so that any failure path (a dead rank, a dead server, Ctrl-C) ends all of
them within seconds and says where their logs are. A child is tied to the launcher from its fork on
(tonpolicy/launch/tied.py), and an interrupt that arrives while a child is being started or while
all are being stopped waits until that is done (`interrupt`), so no signal at any instant leaves one
behind.
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

TIED = Path(__file__).with_name("tied.py")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    # What started it, so the launcher can start it again (a fleet's replaced replica or router).
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

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
    # While a child is being started or all are being stopped, an interrupt is held until that is done.
    holding: bool = False
    held: bool = False

    def interrupt(self, signum: int = signal.SIGINT, frame: object = None) -> None:
        """The launcher's SIGINT/SIGTERM handler: KeyboardInterrupt now, or once the start in progress
        has registered its child (never during stop_all, which is already ending everything)."""
        if self.holding:
            self.held = True
            return
        raise KeyboardInterrupt

    def start_watchdog(self, registry: Path) -> None:
        registry.parent.mkdir(parents=True, exist_ok=True)
        registry.write_text("")
        self.registry = registry
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "tonpolicy.launch.watchdog", str(registry), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def start(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Child:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.holding = True
        try:
            with open(log_path, "ab") as log:  # the child holds its own copy
                proc = subprocess.Popen(
                    [sys.executable, "-I", str(TIED), str(os.getpid()), *argv],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,
                )
            child = Child(name, proc, log_path, list(argv), dict(env or {}))
            self.children.append(child)
            if self.registry is not None:
                with open(self.registry, "a") as f:
                    f.write(f"{proc.pid}\n")
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            self.holding = False
        if self.held:
            self.held = False
            raise KeyboardInterrupt
        return child

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace_s`. Interrupts
        that arrive meanwhile are held for good: this is the clean-up they ask for."""
        self.holding = True
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
