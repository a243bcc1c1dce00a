"""The exit codes of a job, one table (README's "A run" lists the same; a test compares the two).

torchrun reports any failing rank as 1, so the trainer's verdict (gate, handshake) travels in
STATUS_FILE in the run directory, which the launcher reads.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INVALID_CONFIG = 2
EXIT_GATE_FAILED = 3
EXIT_CHILD_FAILED = 4
EXIT_SERVER_UNHEALTHY = 5
EXIT_HANDSHAKE = 6
EXIT_INTERRUPTED = 130

# What each code means, in README's words (its parenthetical details left out).
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_INVALID_CONFIG: "invalid configuration or command line",
    EXIT_GATE_FAILED: "parity gate failed",
    EXIT_CHILD_FAILED: "a trainer rank or the server died",
    EXIT_SERVER_UNHEALTHY: "the server did not become healthy or its port is taken",
    EXIT_HANDSHAKE: "contract handshake refused",
    EXIT_INTERRUPTED: "interrupted",
}

STATUS_FILE = "trainer_status.json"
