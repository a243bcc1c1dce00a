"""Two nodes simulated on this machine: two launchers (`python -m tonpolicy trainer.nnodes=2`), node 0
hosting the rollout server and global rank 0, node 1 running trainer ranks only, meeting at node 0's
torchrun store on 127.0.0.1. Exact zero with TP 2 split one rank per node, and PP 2 across the nodes;
a node that dies ends the other within seconds, its completed records intact."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from e2e_common import records, start_job, summary, wait_for

from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.ports import free_port


def start_nodes(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path, subprocess.Popen, Path]:
    ckpt = tmp_path / "ckpt"  # one checkpoint every node reads (a shared file system, here one disk)
    save_hf(init_state_dict(ModelConfig(), torch.bfloat16, 0), ModelConfig(), ckpt)
    common = [
        "trainer.nnodes=2",
        f"trainer.master_port={free_port()}",
        f"model.checkpoint={ckpt}",
        *overrides,
    ]
    nodes = []
    for rank in (1, 0):  # either order works: torchrun's store waits for both nodes
        (tmp_path / f"node{rank}").mkdir()
        nodes.append(start_job(tmp_path / f"node{rank}", *common, f"trainer.node_rank={rank}"))
    (p1, d1), (p0, d0) = nodes
    return p0, d0, p1, d1


@pytest.mark.parametrize("layout", ["parallel=tp2", "parallel=pp2"])
def test_two_nodes_are_exact(tmp_path: Path, layout: str) -> None:
    p0, d0, p1, d1 = start_nodes(tmp_path, layout, "experiment.steps=2", "rollout.weight_sync=distributed")
    out0, err0 = p0.communicate(timeout=600)
    out1, err1 = p1.communicate(timeout=120)
    assert p0.returncode == 0, err0[-3000:]
    assert p1.returncode == 0, err1[-3000:]
    recs = records(d0)
    assert [r["step"] for r in recs] == [0, 1]
    assert all(
        r["tokens_scored"] > 0 and r["mismatched_tokens"] == 0 and r["max_abs_logprob_diff"] == 0.0 for r in recs
    )
    assert not records(d1)  # node 1 holds no rank 0: it writes no step records
    assert summary(d1)["status"] == "ok"


def test_a_node_that_dies_ends_the_other(tmp_path: Path) -> None:
    p0, d0, p1, d1 = start_nodes(tmp_path, "parallel=tp2", "experiment.steps=50")
    wait_for(lambda: len(records(d0)) >= 1, 300, "node 0's first step")
    p1.kill()  # kill -9 of node 1's launcher: its watchdog ends its ranks; node 0's next collective fails
    t0 = time.monotonic()
    _, err = p0.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert p0.returncode == 4, err[-3000:]
    print(f"node 0 ended {elapsed:.1f} s after node 1 was killed; {len(records(d0))} step records kept")
    assert elapsed < 30, elapsed
    assert "trainer exited" in err
    kept = records(d0)
    assert len(kept) >= 1 and summary(d0)["steps_completed"] == len(kept)
