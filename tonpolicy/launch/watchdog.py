"""Ends a job's children when the launcher dies without cleaning up (even `kill -9`).

    python -m tonpolicy.launch.watchdog REGISTRY LAUNCHER_PID

The launcher starts this in a session of its own, so it outlives the launcher, and appends the pid
of every child it starts to REGISTRY (each child leads its own process group, which holds its
descendants: torchrun's ranks, SGLang's schedulers). When the watchdog's parent is no longer
LAUNCHER_PID (the launcher is gone, perhaps before the watchdog ran at all) it notes every descendant
of the registered children (torchrun starts each rank in a session of its own, so process groups do
not hold them), SIGTERMs the registered groups (torchrun and SGLang stop their workers on SIGTERM),
SIGKILLs every noted process still alive after 5 s, and exits. After a clean exit the children are
already gone and it only exits. Linux (/proc).
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


def _send(ids: set[int] | list[int], sig: int, kill=os.kill) -> bool:  # noqa: ANN001 - os.kill or os.killpg
    """Send `sig` to every pid (or process group, with kill=os.killpg); True if any still existed."""
    alive = False
    for target in ids:
        try:
            kill(target, sig)
            alive = True
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def main(argv: list[str]) -> int:
    registry, parent = Path(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is the launcher's to handle
    while os.getppid() == parent:
        time.sleep(POLL_S)
    groups = _groups(registry)
    tree = descendants(groups)
    if _send(groups, signal.SIGTERM, os.killpg) or tree:
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and (_send(groups, 0, os.killpg) or _send(tree, 0)):
            time.sleep(0.1)
        _send(groups, signal.SIGKILL, os.killpg)
        _send(tree, signal.SIGKILL)
    registry.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
