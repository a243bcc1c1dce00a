"""Which node a launcher is: from trainer.node_rank, a scheduler's task (submitit on SLURM, read through
submitit's own JobEnvironment from SLURM's variables), $NODE_RANK or $SLURM_NODEID. A job whose tasks are
not one per node is refused with the key, the value and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from tonpolicy.config.schema import Config
from tonpolicy.launch.nodes import node_dir, place, scheduler_task
from tonpolicy.validation.validate import ConfigError

SLURM_TASK_1 = {  # task 1 of a 2-node job with one task per node, as srun starts it
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


def two_nodes(**trainer: object) -> Config:
    cfg = Config()
    cfg.trainer.nnodes = 2
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def test_a_slurm_task_is_the_node_of_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLURM_TASK_1.items():
        monkeypatch.setenv(key, value)
    task = scheduler_task()
    assert task is not None and (task.rank, task.tasks, task.nodes, task.hosts) == (1, 2, 2, ["gpu07", "gpu08"])
    placed = place(two_nodes(), task)
    assert placed.trainer.node_rank == 1
    assert placed.trainer.master_addr == "gpu07"  # node 0 is the job's first host
    assert node_dir(placed, Path("/r")) == Path("/r/node1")
    # An address the user gave wins over the scheduler's host list.
    assert place(two_nodes(master_addr="10.0.0.5"), task).trainer.master_addr == "10.0.0.5"


def test_tasks_that_are_not_one_per_node_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**SLURM_TASK_1, "SLURM_NTASKS": "4"}.items():  # 2 tasks on each of 2 hosts
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        place(two_nodes(), scheduler_task())
    message = str(err.value)
    assert "2 problem(s)" in message  # every problem at once
    assert "hydra.launcher.tasks_per_node=4" in message and "trainer.nnodes=2" in message
    assert "hydra.launcher.nodes=2" in message and "one task per host" in message


def test_without_a_scheduler_the_environment_names_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert scheduler_task() is None
    monkeypatch.setenv("NODE_RANK", "1")
    assert place(two_nodes(), None).trainer.node_rank == 1
    assert place(two_nodes(node_rank=0), None).trainer.node_rank == 0  # the config wins
    assert place(Config(), None).trainer.node_rank == 0  # a one-node run ignores $NODE_RANK
    assert node_dir(place(Config(), None), Path("/r")) == Path("/r")
    monkeypatch.setenv("NODE_RANK", "5")
    with pytest.raises(ConfigError, match=r"trainer.node_rank=5: must be in \[0, trainer.nnodes=2\)"):
        place(two_nodes(), None)
