"""Two nodes simulated on this machine: two launchers (`python -m tonpolicy trainer.nnodes=2`), node 0
hosting the rollout server and global rank 0, node 1 running trainer ranks only, meeting at node 0's
torchrun store on 127.0.0.1. Exact zero with TP 2 split one rank per node, and PP 2 across the nodes;
a node that dies ends the other within seconds, its completed records intact."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.e2e_common import FAST, records, start_job, summary, wait_for

from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.ports import free_port


def save_checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"  # one checkpoint every node reads (a shared file system, here one disk)
    save_hf(init_state_dict(ModelConfig(), torch.bfloat16, 0), ModelConfig(), ckpt)
    return ckpt


def start_nodes(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path, subprocess.Popen, Path]:
    ckpt = save_checkpoint(tmp_path)
    common = [
        "trainer.nnodes=2",
        f"trainer.master_port={free_port()}",
        f"model.checkpoint={ckpt}",
        *overrides,
    ]
    # Either order works (torchrun's store waits for both nodes); one run directory for both, as on a
    # shared file system: node 1 writes under node1/ inside it.
    p1, run_dir = start_job(tmp_path, *common, "trainer.node_rank=1")
    p0, _ = start_job(tmp_path, *common, "trainer.node_rank=0")
    return p0, run_dir, p1, run_dir / "node1"


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
    assert summary(d1)["status"] == "ok" and summary(d0)["steps_completed"] == 2  # neither overwrote the other
    assert (d1 / "logs" / "trainer.log").exists() and (d0 / "logs" / "rollout.log").exists()


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


def test_submitit_starts_one_task_per_node(tmp_path: Path) -> None:
    """Hydra's submitit launcher with `hydra/launcher=local_nodes` (submitit's local executor; on a
    cluster `slurm_nodes`, the same launcher with SLURM's executor) starts one task per node; each task
    runs the launcher as the node of its task rank, both in one job directory. Exact zero at TP 2, one
    rank per node."""
    argv = [
        sys.executable, "-m", "tonpolicy", "-m", "hydra/launcher=local_nodes", *FAST,
        "trainer.nnodes=2", f"trainer.master_port={free_port()}", f"model.checkpoint={save_checkpoint(tmp_path)}",
        "parallel=tp2", "experiment.steps=2", "rollout.weight_sync=distributed",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra.launcher.submitit_folder={tmp_path / 'submitit'}",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    job = tmp_path / "sweep" / "0_tp2"
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(job)
    assert [r["step"] for r in recs] == [0, 1], proc.stderr[-3000:]
    assert all(r["tokens_scored"] > 0 and r["mismatched_tokens"] == 0 for r in recs)
    assert summary(job / "node1")["status"] == "ok"  # task 1 ran node 1 (trainer ranks only)
    assert not records(job / "node1")
    assert "| ok " in (tmp_path / "sweep" / "sweep_summary.md").read_text()


def test_a_job_whose_tasks_are_not_its_nodes_is_refused(tmp_path: Path) -> None:
    """Two submitit tasks for a one-node run would each start the whole run: refused, key and rule named."""
    argv = [
        sys.executable, "-m", "tonpolicy", "-m", "hydra/launcher=local_nodes", *FAST,
        "hydra.launcher.tasks_per_node=2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"hydra.launcher.submitit_folder={tmp_path / 'submitit'}",
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    result = summary(tmp_path / "sweep" / "0_tp1")
    assert result["status"] == "invalid_config", proc.stderr[-3000:]
    assert "hydra.launcher.tasks_per_node=2" in result["error"] and "trainer.nnodes=1" in result["error"]
    assert not (tmp_path / "sweep" / "0_tp1" / "logs").exists()  # nothing started
