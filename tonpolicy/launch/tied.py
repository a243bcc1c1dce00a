"""Runs a command tied to the launcher: it receives SIGTERM the moment the launcher dies.

    python -I tied.py LAUNCHER_PID COMMAND [ARG ...]

The launcher starts every child through this: Linux's parent-death signal is set before the command
is exec'd (it survives the exec), and a launcher that died before it was set is caught by comparing
the parent with LAUNCHER_PID. So no instant exists, from the fork on, at which the launcher can die
and leave the child running; the child's own children are its to end on SIGTERM (torchrun ends its
ranks, SGLang's schedulers die with their server). Standard library only, run as a file with -I, so
it imports nothing of tonpolicy and changes nothing in the command's environment.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    launcher, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        print(f"tonpolicy: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 126
    if os.getppid() != launcher:
        return 143  # the launcher is already gone: start nothing
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"tonpolicy: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
