"""Run records in the run directory: metrics.jsonl, samples.jsonl, summary.json.

Each step's record is one line appended and fsynced, so a crash later never loses a completed step;
summary.json is replaced atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Exit codes of a job. torchrun reports any failing rank as 1, so the trainer's verdict (gate,
# handshake) travels in STATUS_FILE, which the launcher reads.
EXIT_GATE_FAILED = 3
EXIT_CHILD_FAILED = 4
EXIT_SERVER_UNHEALTHY = 5
EXIT_HANDSHAKE = 6
EXIT_INTERRUPTED = 130
STATUS_FILE = "trainer_status.json"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a killed writer; earlier lines are complete
    return out
