"""Compose, validate and run a tonpolicy configuration (the command line's steps, as functions)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tonpolicy.config.errors import ConfigIssue
    from tonpolicy.config.schema import Config


def compose(overrides: Sequence[str] = ()) -> Config | list[ConfigIssue]:
    """The typed configuration that `python -m tonpolicy OVERRIDES...` would run, validated; or, when it
    is not runnable, every problem at once (each a `ConfigIssue`: the dotted key, its value and the rule,
    `str()` prints them as the command line does)."""
    from tonpolicy.config.compose import compose_config
    from tonpolicy.config.errors import ConfigError
    from tonpolicy.validation.command_line import command_line_problems

    problems = command_line_problems(list(overrides))
    if problems:
        return problems
    try:
        cfg = compose_config(list(overrides))
    except ConfigError as exc:
        return exc.issues
    return validate(cfg) or cfg


def validate(config: Config) -> list[ConfigIssue]:
    """Every rule `config` breaks (empty when it is runnable): for a Config composed and then changed in
    code."""
    from tonpolicy.validation.validate import ConfigError
    from tonpolicy.validation.validate import validate as check

    try:
        check(config)
    except ConfigError as exc:
        return exc.issues
    return []


@dataclass(frozen=True)
class RunResult:
    """What a job left: its exit code (0 ok, 2 invalid configuration, 3 parity failure, 4 a crash:
    tonpolicy.loop.exit_codes), its run directory, its summary.json (None if it wrote none) and, for an
    invalid configuration, its problems."""

    exit_code: int
    run_dir: Path
    summary: dict[str, Any] | None
    problems: list[ConfigIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def run(config: Config | Sequence[str], run_dir: str | Path) -> RunResult:
    """Run one job (or, with mode=plan, write its launch plan) into `run_dir`, as `python -m tonpolicy`
    does: the servers and trainer ranks are child processes of this one, stopped when the job ends.
    `config` is a composed Config or the overrides to compose. Blocks until the job is over; call it from
    the main thread (the job stops its children on SIGINT and SIGTERM, and restores the handlers after).
    The launcher's progress goes to the `tonpolicy` loggers at INFO (`logging.basicConfig(level=logging.INFO)`
    shows it; unconfigured, only warnings and errors reach stderr); the servers' and ranks' logs are in
    `run_dir/logs/`."""
    from tonpolicy.app import run as run_job
    from tonpolicy.config.errors import ConfigError
    from tonpolicy.loop.exit_codes import EXIT_INVALID_CONFIG

    run_dir = Path(run_dir)
    cfg = compose(config) if _is_overrides(config) else config
    if isinstance(cfg, list):
        return RunResult(EXIT_INVALID_CONFIG, run_dir, None, cfg)
    try:
        code = run_job(cfg, run_dir)
    except ConfigError as exc:
        return RunResult(EXIT_INVALID_CONFIG, run_dir, _summary(run_dir), exc.issues)
    return RunResult(code, run_dir, _summary(run_dir))


def _is_overrides(config: object) -> bool:
    return isinstance(config, Sequence) and not isinstance(config, str)


def _summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None
