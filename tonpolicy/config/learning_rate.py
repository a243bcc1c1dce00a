"""Which learning rate a job trains with: trainer.lr, or the task's own.

A task may fix its own learning rate (task.lr: the one it is known to learn with), which replaces
trainer.lr. A trainer.lr the user gives on the command line is meant to be used, so it wins: the task's
is cleared (task.lr=null in the run's resolved_config.yaml) and a note says so. Given both, task.lr
stands, as its meaning says, and a warning says trainer.lr goes unused.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from tonpolicy.config.schema import Config

TRAINER_LR = "trainer.lr"
TASK_LR = "task.lr"


def learning_rate(cfg: Config) -> float:
    """The learning rate the optimizer gets."""
    return cfg.task.lr if cfg.task.lr is not None else cfg.trainer.lr


def given_lr_wins(dcfg: DictConfig, overrides: Sequence[str]) -> str | None:
    """Apply the rule to `dcfg`, composed from the command line's `overrides` (before it becomes a
    Config); return the line to tell the user, or None when there is nothing to say."""
    given = _given_keys(overrides)
    task_lr = dcfg.task.lr
    if TRAINER_LR not in given or task_lr is None:
        return None
    if TASK_LR in given:
        return (
            f"warning: {TRAINER_LR}={dcfg.trainer.lr} is not used: {TASK_LR}={task_lr}, also given, is the"
            f" learning rate of task {dcfg.task.name}"
        )
    dcfg.task.lr = None
    return (
        f"{TRAINER_LR}={dcfg.trainer.lr}, as given, replaces the learning rate task {dcfg.task.name} sets"
        f" ({TASK_LR}={task_lr})"
    )


def _given_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys the overrides set (`+key=`, `++key=` too; a deletion sets nothing)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {ov.key_or_group for ov in parsed if not ov.is_delete()}
