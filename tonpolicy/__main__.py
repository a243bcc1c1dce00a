"""`python -m tonpolicy [group=option ...]`: thin Hydra glue around tonpolicy.app.run.

The command line is checked first (tonpolicy.validation.command_line), so a bad one ends with exit 2
in tonpolicy's words before Hydra writes or starts anything. `--version` is tonpolicy's, answered
before Hydra (whose own flag prints Hydra's version) or torch is imported."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from tonpolicy.version import build_info, version_line

log = logging.getLogger("tonpolicy")  # __name__ is __main__ under python -m


def job(dcfg: DictConfig) -> None:
    """The task function Hydra runs (wrapped by hydra.main in `main`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from tonpolicy.app import run
    from tonpolicy.config.learning_rate import given_lr_wins
    from tonpolicy.config.names import layout_label
    from tonpolicy.config.schema import Config
    from tonpolicy.files import write_json_atomic
    from tonpolicy.loop.exit_codes import EXIT_INVALID_CONFIG
    from tonpolicy.validation.validate import ConfigError, unknown_keys

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    unknown = unknown_keys(dcfg)  # before to_object, which would drop them silently
    said = given_lr_wins(dcfg, list(hc.overrides.task))
    if said:
        log.log(logging.WARNING if said.startswith("warning") else logging.INFO, f"tonpolicy: {said}")
    cfg: Config = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    try:
        code = run(cfg, run_dir, unknown)
    except ConfigError as exc:
        log.error(f"tonpolicy: {exc}")
        code = EXIT_INVALID_CONFIG
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            run_dir / "summary.json",
            {
                "status": "invalid_config",
                "layout": layout_label(cfg.parallel),
                "contract": cfg.contract.name,
                "error": str(exc),
                "tonpolicy": build_info(),
            },
        )
    if code and hc.mode == RunMode.MULTIRUN:
        # One failed job must not stop the sweep; the sweep summary reports it and sets the exit code.
        log.error(f"tonpolicy: job {hc.job.num} ({hc.job.override_dirname}) exited {code}")
        return
    if code:
        sys.exit(code)


def main() -> None:
    if "--version" in sys.argv[1:]:
        from tonpolicy.loop.exit_codes import EXIT_OK  # no imports of its own: --version stays instant

        print(version_line())  # the command's result
        sys.exit(EXIT_OK)
    from tonpolicy.cpu_memory import tune_malloc

    tune_malloc()  # before the first large tensor: heap-served temporaries (tonpolicy.cpu_memory)
    import hydra

    from tonpolicy.config.compose import CONF_DIR
    from tonpolicy.config.help_groups import register_help_resolver
    from tonpolicy.config.schema import register_configs
    from tonpolicy.loop.exit_codes import EXIT_INVALID_CONFIG
    from tonpolicy.process_exit import exit_now
    from tonpolicy.validation.command_line import check_command_line
    from tonpolicy.validation.validate import ConfigError

    register_configs()
    register_help_resolver()
    try:
        for warning in check_command_line(sys.argv[1:]):
            log.warning(f"tonpolicy: warning: {warning}")  # before Hydra configures logging: stderr as is
    except ConfigError as exc:
        log.error(f"tonpolicy: {exc}")
        sys.exit(EXIT_INVALID_CONFIG)
    # An absolute path: the console script (module tonpolicy.__main__) would otherwise look for a
    # `tonpolicy.conf` Python package, which the config folder is not.
    hydra_job = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(job)
    try:
        hydra_job()
    except SystemExit as done:
        exit_now(done.code)
    # Every child is stopped and every file written: no teardown of what the launcher imported.
    exit_now(0)


if __name__ == "__main__":
    main()
