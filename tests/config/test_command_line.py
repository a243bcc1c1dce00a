"""A bad `python -m tonpolicy` command line ends with exit 2 and tonpolicy's own message, every problem
at once, before Hydra writes or starts anything (issue 39)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tonpolicy.config.compose import load_config
from tonpolicy.validation.command_line import unusable_dir

HEADER = "tonpolicy: invalid configuration ("


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(tmp_path: Path, *args: str) -> str:
    """Run the command line in `tmp_path` (TMPDIR inside it); assert exit 2, nothing written or started
    (the launcher writes its plan into the run folder before it starts a process); return stderr."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    before = files_under(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert files_under(tmp_path) == before
    assert proc.stdout == ""
    assert proc.stderr.startswith(HEADER), proc.stderr
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    return proc.stderr


def problems(stderr: str) -> list[str]:
    return [line.removeprefix("  - ") for line in stderr.splitlines()[1:]]


@pytest.fixture
def user_task(tmp_path: Path) -> Path:
    """The user's own option of the task group, in conf/ of the working directory."""
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "mine.yaml").write_text("defaults: [base_task, _self_]\nname: constant\n")
    return tmp_path


def test_unknown_option_lists_the_package_and_the_user_options(user_task: Path) -> None:
    run_dir = user_task / "run"
    (line,) = problems(refused(user_task, "task=math", f"hydra.run.dir={run_dir}"))
    assert line.startswith("task='math': no such option of the task group (options: calculator, constant, digit_copy, ")
    assert "first_parity, mine; from tonpolicy/conf/task/ and conf/task/)" in line
    # The sweep form: the sweep folder is not made either.
    sweep = user_task / "sweep"
    stderr = refused(user_task, "-m", "mode=plan", "task=mine,first_parityy", f"hydra.sweep.dir={sweep}")
    (line,) = problems(stderr)
    assert line.startswith("task='first_parityy': no such option of the task group; did you mean task=first_parity?")
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", "--cfg", "job", "task=mine"],
        cwd=user_task,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "name: constant" in proc.stdout, proc.stderr  # the user's option is one


def test_unknown_key_without_plus_is_named_with_its_closest_keys(tmp_path: Path) -> None:
    stderr = refused(tmp_path, "experiment.task=math", "experiment.temprature=0.5", "experiment.lr=0.1")
    assert stderr.startswith(HEADER + "3 problem(s)):")
    moved, typo, elsewhere = problems(stderr)
    assert moved == (
        "experiment.task='math': unknown key (not in the schema); task is a config group of its own:"
        " task=<option> (options: calculator, constant, digit_copy, echo_digit, first_digit, first_parity), or"
        " task.<field>=... for one field"
    )
    # The same words as the `+` form, which composition lets through to the schema check.
    assert typo == "experiment.temprature=0.5: unknown key (not in the schema); did you mean experiment.temperature?"
    assert elsewhere == "experiment.lr=0.1: unknown key (not in the schema); lr is task.lr and trainer.lr"
    (plus,) = problems(refused(tmp_path, "+experiment.temprature=0.5"))
    assert plus == typo
    sweep = tmp_path / "sweep"
    (line,) = problems(refused(tmp_path, "-m", "experiment.task=a,b", f"hydra.sweep.dir={sweep}"))
    assert line.startswith("experiment.task='a,b': unknown key (not in the schema); task is a config group")


def test_run_folder_that_cannot_be_made(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("in the way\n")
    run_dir = tmp_path / "afile" / "run"
    (line,) = problems(refused(tmp_path, "mode=plan", f"hydra.run.dir={run_dir}"))
    assert line == f"hydra.run.dir='{run_dir}': cannot be created: {tmp_path / 'afile'} is a file, not a directory"
    sweep = tmp_path / "afile" / "sweep"
    (line,) = problems(refused(tmp_path, "-m", "mode=plan", "parallel=tp1,tp2", f"hydra.sweep.dir={sweep}"))
    assert line == f"hydra.sweep.dir='{sweep}': cannot be created: {tmp_path / 'afile'} is a file, not a directory"
    # With other problems on the line: all of them at once.
    stderr = refused(tmp_path, "task=math", "parallel.tp=abc", f"hydra.run.dir={tmp_path / 'afile'}")
    assert problems(stderr) == [
        "task='math': no such option of the task group (options: calculator, constant, digit_copy, echo_digit,"
        " first_digit, first_parity; from tonpolicy/conf/task/ and conf/task/)",
        "parallel.tp='abc': must be an integer",
        f"hydra.run.dir='{tmp_path / 'afile'}': exists and is not a directory",
    ]


def test_every_other_bad_override_at_once(tmp_path: Path) -> None:
    stderr = refused(
        tmp_path,
        "parallel.tp==2",
        "parallel=tp1",
        "parallel=tp2",
        "foo=bar",
        "experiment.temperature=hot",
        "parallel.pp_layers=[a,1]",
        "trainer.device",
        "parallel=tp1,tp4",
    )
    assert problems(stderr) == [
        "parallel.tp='=2': not a valid override (extraneous input '='); write key=value, quoting a value that"
        " holds spaces or any of = , [ ] { } ( ) ' \"",
        "trainer.device='': not a valid override (missing EQUAL at '<EOF>'); write key=value, quoting a value"
        " that holds spaces or any of = , [ ] { } ( ) ' \"",
        "foo='bar': unknown key (not in the schema); the config groups are contract, experiment, logger, model,"
        " parallel, rollout, task, trainer",
        "experiment.temperature='hot': must be a number",
        "parallel.pp_layers=['a', 1]: must be a list of integers",
        "parallel='tp1,tp4': a sweep needs -m (--multirun); for a list write key=[a,b], for a string quote it",
    ]


def test_a_key_given_twice_warns_and_the_last_stands(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", "mode=plan", "parallel=tp1", "trainer.lr=0.1", "parallel=tp2"]
        + ["trainer.lr=0.2", "mode=plan", "trainer.lr=0.5", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if line.startswith("tonpolicy: warning:")]
    assert warned == [  # mode=plan given twice alike changes nothing: no warning
        "tonpolicy: warning: parallel is given twice (parallel=tp1, then parallel=tp2); the last one stands:"
        " parallel=tp2",
        "tonpolicy: warning: trainer.lr is given 3 times (trainer.lr=0.1, then trainer.lr=0.2, then"
        " trainer.lr=0.5); the last one stands: trainer.lr=0.5",
    ]
    assert json.loads((run_dir / "launch_plan.json").read_text())["layout"] == "tp2"
    # The trainer.lr given wins over the default task's own (tests/config/test_learning_rate.py).
    assert "tonpolicy: trainer.lr=0.5, as given, replaces the learning rate task first_parity sets" in proc.stderr
    cfg = load_config(run_dir / "resolved_config.yaml")
    assert (cfg.trainer.lr, cfg.task.lr) == (0.5, None)


def test_a_sweep_given_twice_keeps_the_last_as_hydras_sweeper_does(tmp_path: Path) -> None:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tonpolicy.validation.command_line import command_line_findings

    sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    for first, last, jobs in (
        ("parallel=tp1,tp2", "parallel=tp4", ["tp4"]),
        ("parallel=tp1", "parallel=tp2,tp4", ["tp2", "tp4"]),
    ):
        issues, warnings = command_line_findings(["-m", "mode=plan", first, last, sweep])
        assert issues == []
        assert warnings == [f"parallel is given twice ({first}, then {last}); the last one stands: {last}"]
        (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides([first, last]), None)
        assert batch == [[f"parallel={job}"] for job in jobs]
    assert command_line_findings(["-m", "mode=plan", "parallel=tp1,tp2", "parallel=tp1,tp2", sweep]) == ([], [])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--frobnicate"], "command line='--frobnicate': unrecognized arguments: --frobnicate"),
        (["hydra/launcher=nope"], "hydra/launcher='nope': In 'hydra/config': Could not find 'hydra/launcher/nope';"),
        (["+parallel.tp=2"], "+parallel.tp='2': Could not append to config. An item is already at 'parallel.tp'."),
    ],
)
def test_what_hydra_refuses_is_in_tonpolicys_words(tmp_path: Path, args: list[str], expected: str) -> None:
    (line,) = problems(refused(tmp_path, *args))
    assert line.startswith(expected), line


def test_unknown_mode_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Validated inside the job (its run folder holds the summary), still before anything starts."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", "mode=bogus", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "  - mode='bogus': must be one of ['plan', 'run', 'align']" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not (run_dir / "launch_plan.json").exists() and not (run_dir / "logs").exists()


def test_unusable_dir(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    assert unusable_dir(tmp_path) is None
    assert unusable_dir(tmp_path / "new" / "deeper") is None
    assert unusable_dir(tmp_path / "f") == "exists and is not a directory"
    assert unusable_dir(tmp_path / "f" / "a" / "b") == f"cannot be created: {tmp_path / 'f'} is a file, not a directory"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert unusable_dir(tmp_path / "dangling") == f"is a broken symbolic link (to {tmp_path / 'gone'})"
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o555)
        assert (
            unusable_dir(tmp_path / "ro" / "run")
            == f"cannot be created: {tmp_path / 'ro'} is not writable by this user"
        )
