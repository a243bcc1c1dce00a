"""Atomic file writes: the one way every layer writes a record another process may read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    """Write via a temp file + rename, so a crash or a polling reader never sees a half-written file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, target)
    return target


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 2) -> Path:
    return write_atomic(path, json.dumps(data, indent=indent) + "\n")
