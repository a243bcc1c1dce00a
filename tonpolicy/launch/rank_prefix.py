"""`[rankK]: ` before every line a trainer rank writes, so the ranks' output, interleaved in one log,
can be told apart (torchrun's own prefix for a rank's error, which the launcher's root-cause reader strips).

Python-level: print, logging and tracebacks through sys.stdout/sys.stderr; what C++ writes to the file
descriptors directly stays unprefixed."""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO


class PrefixedStream(io.TextIOBase):
    """Writes `prefix` at the start of each line, passing everything else through at once (no buffering
    of its own: a rank that dies loses nothing it wrote)."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix, self.at_line_start = stream, prefix, True

    def write(self, s: str) -> int:
        out = []
        for piece in s.splitlines(keepends=True):
            if self.at_line_start:
                out.append(self.prefix)
            out.append(piece)
            self.at_line_start = piece.endswith(("\n", "\r"))
        self.stream.write("".join(out))
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


def prefix_rank_output(env: dict[str, str] | None = None) -> str | None:
    """Prefix this process's stdout and stderr with its global rank (torchrun's RANK) when there are
    several ranks; returns the prefix (None: one rank, or not under torchrun)."""
    env = dict(os.environ) if env is None else env
    if "RANK" not in env or int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    prefix = f"[rank{env['RANK']}]: "
    sys.stdout = PrefixedStream(sys.stdout, prefix)  # type: ignore[assignment]
    sys.stderr = PrefixedStream(sys.stderr, prefix)  # type: ignore[assignment]
    return prefix
