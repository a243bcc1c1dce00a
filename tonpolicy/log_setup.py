"""Python `logging` for tonpolicy's processes, so that levels decide what is shown.

Every module logs on its own logger (`logging.getLogger(__name__)`, under `tonpolicy`). The launcher's
logging is Hydra's: `conf/hydra/job_logging/tonpolicy.yaml` writes the bare message to stderr (what the
launcher printed before, so stdout keeps only a command's result, e.g. mode=plan's JSON) and a timed
copy to the run directory's `__main__.log`; `hydra.verbose=true` (or `=tonpolicy`) and
`hydra.job_logging.root.level=WARNING` work as in any Hydra app. The child processes (the embedded
rollout server, the trainer ranks) call `configure_process`: INFO by default, or `$TONPOLICY_LOG_LEVEL`,
through the rank prefix of `tonpolicy.launch.rank_prefix`.

A program that calls `tonpolicy.api.run` configures logging as it likes (`logging.basicConfig(level=
logging.INFO)` shows the launcher's lines); without it only warnings and errors reach stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

LOG_LEVEL_ENV = "TONPOLICY_LOG_LEVEL"


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler on whatever `sys.stderr` is when a record is written, not when the handler was
    made: the rank prefix swaps sys.stderr for a prefixing stream, and pytest swaps it to capture."""

    def __init__(self, level: int | str = logging.NOTSET) -> None:
        logging.Handler.__init__(self, level)

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass  # StreamHandler.setStream would rebind it; this handler follows sys.stderr instead


def level_from_env(env: dict[str, str] | None = None, default: str = "INFO") -> int:
    """`$TONPOLICY_LOG_LEVEL` (a name such as DEBUG or WARNING, or a number), else `default`."""
    value = (os.environ if env is None else env).get(LOG_LEVEL_ENV, "").strip() or default
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={value!r}: not a logging level (DEBUG, INFO, WARNING, ERROR)")
    return level


def configure_process(level: int | None = None) -> logging.Logger:
    """A child process's `tonpolicy` logger: bare messages to the current stderr at `level` (default
    `$TONPOLICY_LOG_LEVEL`, else INFO). Other libraries' loggers are left as they were (warnings only), so
    the trainer's log does not fill with megatron's or torch's INFO lines. Calling it again only sets the
    level."""
    logger = logging.getLogger("tonpolicy")
    logger.setLevel(level_from_env() if level is None else level)
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.propagate = False  # the root's handlers (if a library added one) would print each line twice
    return logger
