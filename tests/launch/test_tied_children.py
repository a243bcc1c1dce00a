"""A child is tied to the launcher from its fork on: a launcher killed at the worst instant (right
after the fork, before it registered the child anywhere) still leaves nothing behind. Control: the
same child started without the tie outlives the launcher. An interrupt during a start is held until
the child is registered, so the clean-up that follows knows it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.e2e_common import pid_alive
from support.orphans import marked

from tonpolicy.launch import procs
from tonpolicy.launch.procs import TIED, ProcessGroup

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _launcher_dies_after_fork(tied: bool, mark: str, wait_s: float) -> list[int]:
    """A launcher that forks a child and SIGKILLs itself before doing anything else with it; returns
    the marked processes still alive after up to `wait_s`."""
    argv = [sys.executable, "-I", str(TIED), "{pid}", *SLEEPER] if tied else SLEEPER
    script = (
        "import os, signal, subprocess, sys, time\n"
        f"argv = [a.replace('{{pid}}', str(os.getpid())) for a in {argv!r}]\n"
        "subprocess.Popen(argv, start_new_session=True)\n"
        "time.sleep(0.3)\n"  # the child is past its tie (or, untied, simply running)
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "TONPOLICY_ORPHAN_PROBE": mark}, timeout=60)
    deadline = time.monotonic() + wait_s
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    return marked(mark)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied_control"])
def test_a_launcher_killed_right_after_the_fork_leaves_nothing(tied: bool) -> None:
    # Tied: gone within 10 s (at once, in fact). The control needs no 10 s to show it stays.
    left = _launcher_dies_after_fork(tied, f"tied-{tied}-{os.getpid()}", 10 if tied else 2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert (left == []) is tied, left


def test_a_child_whose_launcher_is_already_gone_never_runs(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    not_the_parent = 1
    proc = subprocess.run([sys.executable, "-I", str(TIED), str(not_the_parent), *command], timeout=30)
    assert proc.returncode == 143 and not ran.exists()
    proc = subprocess.run([sys.executable, "-I", str(TIED), str(os.getpid()), *command], timeout=30)
    assert proc.returncode == 0 and ran.exists()


def test_an_interrupt_during_a_start_waits_for_the_child_to_be_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = ProcessGroup()
    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - subprocess.Popen's own
        proc = real_popen(*args, **kwargs)
        group.interrupt()  # Ctrl-C at the worst instant: forked, not yet known to the group
        return proc

    monkeypatch.setattr(procs.subprocess, "Popen", popen_then_signal)
    try:
        with pytest.raises(KeyboardInterrupt):
            group.start("sleeper", SLEEPER, tmp_path / "sleeper.log")
        assert [c.name for c in group.children] == ["sleeper"] and group.children[0].alive()
    finally:
        group.stop_all(grace_s=2)
    assert not pid_alive(group.children[0].proc.pid)
    group.interrupt()  # held for good once stopping: the clean-up is what it asks for
