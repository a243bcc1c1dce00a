"""Ending a process whose work is done without the interpreter's teardown.

Tearing down a process that imported torch, Megatron and W&B takes seconds (every module, thread pool and
finalizer in turn), and a job waits for that on each of its processes: the trainer ranks, the rollout
server, the launcher. Their entry points call `exit_now` once everything they write is written and closed
(files fsynced, W&B finished, process groups destroyed), so skipping the teardown loses nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_code(code: object) -> int:
    """What the interpreter would exit with for `sys.exit(code)` (a message is printed, then 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(code: object = 0) -> NoReturn:
    """Flush the log handlers and the standard streams, then end the process with `code` at once."""
    status = exit_code(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(status)
