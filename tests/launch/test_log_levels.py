"""Python logging: Hydra's levels decide what the launcher shows (its job_logging, as `python -m tonpolicy`
configures it), and the child processes log at INFO by default through the rank prefix."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import configure_log
from omegaconf import OmegaConf, open_dict

from tonpolicy.app import run
from tonpolicy.config.compose import CONF_DIR
from tonpolicy.config.schema import Config, register_configs
from tonpolicy.log_setup import LOG_LEVEL_ENV, level_from_env

WRITTEN = "launch plan written to"  # the launcher's INFO line in mode=plan


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """dictConfig replaces the root logger's handlers and level: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def plan_run(tmp_path: Path, name: str, *log_overrides: str) -> Config:
    """Configure logging as Hydra does for a job with `log_overrides`, then run mode=plan through `run`."""
    register_configs()
    run_dir = tmp_path / name
    overrides = ["mode=plan", "logger=none", f"hydra.runtime.output_dir={run_dir}", *log_overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    run_dir.mkdir(parents=True)
    configure_log(dcfg.hydra.job_logging, dcfg.hydra.verbose)
    with open_dict(dcfg):
        del dcfg["hydra"]
    cfg: Config = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    assert run(cfg, run_dir) == 0
    return cfg


def test_hydra_levels_decide_what_the_launcher_shows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    # Hydra's default level (INFO): the line on stderr, bare as it was printed; stdout keeps only the plan.
    plan_run(tmp_path, "info", "hydra.verbose=false")
    out, err = capsys.readouterr()
    assert f"{WRITTEN} {tmp_path / 'info' / 'launch_plan.json'}" in err.splitlines()[-1]
    assert json.loads(out)["contract"]["name"]  # nothing but the plan on stdout
    assert WRITTEN in (tmp_path / "info" / "app.log").read_text()  # the timed copy in the run directory
    # A level override hides INFO ...
    plan_run(tmp_path, "warning", "hydra.verbose=false", "hydra.job_logging.root.level=WARNING")
    out, err = capsys.readouterr()
    assert WRITTEN not in err and json.loads(out)["contract"]["name"]  # the command's result still shown
    # ... and hydra.verbose names the loggers that show DEBUG (and so INFO) over it.
    plan_run(tmp_path, "verbose", "hydra.verbose=tonpolicy", "hydra.job_logging.root.level=WARNING")
    assert WRITTEN in capsys.readouterr().err


def test_the_child_processes_level() -> None:
    assert level_from_env({}) == logging.INFO  # the server's and the ranks' default
    assert level_from_env({LOG_LEVEL_ENV: "warning"}) == logging.WARNING
    assert level_from_env({LOG_LEVEL_ENV: "10"}) == logging.DEBUG
    with pytest.raises(ValueError, match=LOG_LEVEL_ENV):
        level_from_env({LOG_LEVEL_ENV: "loud"})
