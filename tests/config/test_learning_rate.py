"""trainer.lr given on the command line wins over the learning rate a task sets (task.lr)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tonpolicy.config.compose import compose_config
from tonpolicy.config.learning_rate import given_lr_wins, learning_rate

TASK_LR = 0.015  # the default task's (first_parity) own


def test_a_given_trainer_lr_wins_over_the_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose_config(["trainer.lr=0.5"])
    assert (learning_rate(cfg), cfg.task.lr) == (0.5, None)
    assert capsys.readouterr().err == (
        f"tonpolicy: trainer.lr=0.5, as given, replaces the learning rate task first_parity sets (task.lr={TASK_LR})\n"
    )


def test_the_tasks_lr_stands_when_trainer_lr_is_not_given(capsys: pytest.CaptureFixture[str]) -> None:
    # The control: the task's own, over trainer.lr's default; nothing said.
    cfg = compose_config(["experiment.seed=1"])
    assert (learning_rate(cfg), cfg.task.lr, cfg.trainer.lr) == (TASK_LR, TASK_LR, 1e-3)
    # A task that sets none: trainer.lr, given or not.
    assert learning_rate(compose_config(["task=calculator"])) == 1e-3
    assert learning_rate(compose_config(["task=calculator", "trainer.lr=0.5"])) == 0.5
    assert capsys.readouterr().err == ""


def test_both_given_task_lr_stands_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose_config(["trainer.lr=0.5", "task.lr=0.02"])
    assert learning_rate(cfg) == 0.02
    assert capsys.readouterr().err == (
        "tonpolicy: warning: trainer.lr=0.5 is not used: task.lr=0.02, also given, is the learning rate of task"
        " first_parity\n"
    )


@pytest.mark.parametrize(
    ("overrides", "task_lr"),
    [(["++trainer.lr=0.5"], None), (["trainer.lr=0.5", "~task.lr"], None), (["~trainer.lr"], TASK_LR), ([], TASK_LR)],
)
def test_which_overrides_give_trainer_lr(overrides: list[str], task_lr: float | None) -> None:
    dcfg = OmegaConf.create({"trainer": {"lr": 0.5}, "task": {"name": "t", "lr": TASK_LR}})
    given_lr_wins(dcfg, overrides)
    assert dcfg.task.lr == task_lr


def test_an_experiment_that_sets_task_lr_is_obeyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-run experiment (`# @package _global_`, the user's own under ./conf) is composed after the
    task group, so the learning rate it sets is the run's, not silently the task's."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ntask:\n  lr: 0.003\nexperiment:\n  name: mine\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["experiment=mine"])
    assert (cfg.experiment.name, learning_rate(cfg)) == ("mine", 0.003)
    assert learning_rate(compose_config([])) == TASK_LR  # the control: the task's own without it
