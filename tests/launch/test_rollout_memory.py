"""The rollout servers' peak memory in the step record: each server's process tree (SGLang's server has
child processes), read from /proc through the pids the launcher writes; the router is not a server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tonpolicy.cpu_memory import process_tree, tree_peak_rss_mib
from tonpolicy.loop.records import rollout_peak_memory

HELD_MIB = 96
# A server stand-in: a parent whose child touches HELD_MIB (the tree's peak must count the child).
SERVER = (
    f"import subprocess, sys, time; HOLD = 'import time; x = bytearray({HELD_MIB} << 20); time.sleep(60)'\n"
    "child = subprocess.Popen([sys.executable, '-c', HOLD])\n"
    "time.sleep(60)\n"
)


def holding(proc: subprocess.Popen, mib: int) -> subprocess.Popen:
    deadline = time.monotonic() + 30
    while (tree_peak_rss_mib(proc.pid) or 0) < mib and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc


@pytest.fixture
def server() -> subprocess.Popen:
    proc = holding(subprocess.Popen([sys.executable, "-c", SERVER]), HELD_MIB)
    yield proc
    for pid in reversed(process_tree(proc.pid)):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    proc.wait()


def test_a_servers_tree_peak_is_in_the_record(
    tmp_path: Path, server: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert rollout_peak_memory(tmp_path) == {}  # no pids.json: a trainer started by hand records none
    tree = process_tree(server.pid)
    assert len(tree) == 2 and tree[0] == server.pid
    router = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(160 << 20); time.sleep(60)"])
    holding(router, 160)
    try:
        pids = {"rollout": server.pid, "rollout-router": router.pid, "trainer": router.pid}
        (tmp_path / "pids.json").write_text(json.dumps(pids))
        peak = rollout_peak_memory(tmp_path)["peak_rollout_rss_mib"]
        assert HELD_MIB < peak < 160  # the child's memory counted; the router's not
        monkeypatch.setitem(sys.modules, "psutil", None)  # without psutil: the tree from /proc
        assert process_tree(server.pid) == tree
    finally:
        router.kill()
        router.wait()
    assert tree_peak_rss_mib(router.pid) is None  # a process that is gone
