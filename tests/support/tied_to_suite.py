"""A process a test starts ends with the test session: started through the launcher's tie
(tonpolicy/launch/tied.py), it receives SIGTERM when the pytest process dies, so a killed or timed-out
session leaves no server or job running."""

from __future__ import annotations

import os
import sys

from tonpolicy.launch.procs import TIED


def tied_to_suite(argv: list[str]) -> list[str]:
    """`argv` run through the tie to this process (the command is exec'd: its pid is the Popen's)."""
    return [sys.executable, "-I", str(TIED), str(os.getpid()), *argv]
