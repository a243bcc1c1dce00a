"""Ends a job's children when the launcher dies without cleaning up (even `kill -9`).

    python -m tonpolicy.launch.watchdog REGISTRY

The launcher starts this in a session of its own, so it outlives the launcher, and appends the pid
of every child it starts to REGISTRY (each child leads its own process group, which holds its
descendants: torchrun's ranks, SGLang's schedulers). When the watchdog's parent changes (the launcher
is gone) it notes every descendant of the registered children (torchrun starts each rank in a session
of its own, so process groups do not hold them), SIGTERMs the registered groups (torchrun and SGLang
stop their workers on SIGTERM), SIGKILLs every noted process still alive after 5 s, and exits. After
a clean exit the children are already gone and it only exits. Linux (/proc).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.2
GRACE_S = 5.0


def _groups(registry: Path) -> list[int]:
    try:
        return [int(line) for line in registry.read_text().split() if line.strip().isdigit()]
    except OSError:
        return []


def descendants(roots: list[int]) -> set[int]:
    """`roots` and every live process below them (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().split(")")[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found and Path(f"/proc/{pid}").exists():
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _kill(pids: set[int], sig: int) -> bool:
    alive = False
    for pid in pids:
        try:
            os.kill(pid, sig)
            alive = True
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def _signal_all(groups: list[int], sig: int) -> bool:
    """Send `sig` to every group; True if any still existed."""
    alive = False
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
            alive = True
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def main(argv: list[str]) -> int:
    registry = Path(argv[0])
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is the launcher's to handle
    while os.getppid() == parent:
        time.sleep(POLL_S)
    groups = _groups(registry)
    tree = descendants(groups)
    if _signal_all(groups, signal.SIGTERM) or tree:
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and (_signal_all(groups, 0) or _kill(tree, 0)):
            time.sleep(0.1)
        _signal_all(groups, signal.SIGKILL)
        _kill(tree, signal.SIGKILL)
    registry.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
