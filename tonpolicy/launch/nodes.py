"""Which node of a run this launcher is, and where node 0 is.

The node rank comes from, in order: `trainer.node_rank`; a scheduler's task (submitit, as Hydra's
submitit launchers run it: one task per node, the task's rank is the node's, and node 0's host is
the first of the job's hosts); `$NODE_RANK`; SLURM's `$SLURM_NODEID`; else 0. Node 0 hosts the
rollout server and global rank 0; a worker node writes under `<run_dir>/node<k>/`, so nodes that
share one directory (a shared file system, one submitit job) never overwrite each other's files.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from tonpolicy.config.errors import ConfigError, ConfigIssue
from tonpolicy.config.schema import Config
from tonpolicy.config.server_access import LOOPBACK

LAUNCHER_HINT = "hydra/launcher=slurm_nodes (or local_nodes) starts trainer.nnodes tasks, one per node"


@dataclass(frozen=True)
class SchedulerTask:
    """This process's place in a scheduler's job (submitit's JobEnvironment, SLURM or local)."""

    rank: int
    tasks: int
    nodes: int
    hosts: list[str]


def scheduler_task() -> SchedulerTask | None:
    if not os.environ.get("SUBMITIT_EXECUTOR"):  # set by submitit in every task it starts
        return None
    import submitit

    env = submitit.JobEnvironment()
    return SchedulerTask(env.global_rank, env.num_tasks, env.num_nodes, list(env.hostnames))


def place(cfg: Config, task: SchedulerTask | None) -> Config:
    """`cfg` with `trainer.node_rank` (and, under a scheduler, node 0's address) filled in; a job whose
    tasks do not map one-to-one onto the run's nodes is refused before anything starts."""
    t, issues = cfg.trainer, []
    rank, master_addr = t.node_rank, t.master_addr
    if task is not None:
        if task.tasks != t.nnodes:
            issues.append(
                ConfigIssue(
                    "hydra.launcher.tasks_per_node",
                    task.tasks,
                    f"the job has {task.tasks} task(s) for trainer.nnodes={t.nnodes}: each task runs one node "
                    f"({LAUNCHER_HINT})",
                )
            )
        if task.nodes > 1 and task.tasks != task.nodes:
            issues.append(
                ConfigIssue(
                    "hydra.launcher.nodes",
                    task.nodes,
                    f"{task.tasks} task(s) on {task.nodes} hosts: one task per host ({LAUNCHER_HINT})",
                )
            )
        if rank is None:
            rank = task.rank
        if task.nodes > 1 and master_addr in LOOPBACK:  # node 0 is the job's first host
            master_addr = task.hosts[0]
    if issues:
        raise ConfigError(issues)
    if rank is None:  # a one-node run ignores these: they may be set for some other job
        rank = int(os.environ.get("NODE_RANK") or os.environ.get("SLURM_NODEID") or 0) if t.nnodes > 1 else 0
    if not 0 <= rank < t.nnodes:
        raise ConfigError([ConfigIssue("trainer.node_rank", rank, f"must be in [0, trainer.nnodes={t.nnodes})")])
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, node_rank=rank, master_addr=master_addr))


def node_dir(cfg: Config, run_dir: Path) -> Path:
    """Where this node writes: the run directory on node 0, `node<k>/` inside it on node k."""
    rank = cfg.trainer.node_rank or 0
    return run_dir / f"node{rank}" if rank else run_dir
