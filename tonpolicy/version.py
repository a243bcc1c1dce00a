"""What code a run ran: the package version and the git commit of the checkout it was imported from.

`build_info()` goes into every run's summary.json and W&B config, and `python -m tonpolicy --version`
prints `version_line()`. Nothing here may fail a run: without git, outside a checkout, or past the
timeout, the commit is None.
"""

from __future__ import annotations

import functools
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGE = "tonpolicy"
PACKAGE_DIR = Path(__file__).resolve().parent
GIT_TIMEOUT_S = 3.0


def package_version() -> str | None:
    """The installed distribution's version, else pyproject.toml's beside the package (a source tree
    that was never installed), else None."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        pass
    try:
        with open(PACKAGE_DIR.parent / "pyproject.toml", "rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return project.get("version") if project.get("name") == PACKAGE else None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD's full sha, whether tracked files differ from it) of the checkout holding this package;
    (None, None) when the package does not sit in one. A wheel installed into a virtual environment
    inside some repository is not that repository's code, so the checkout must hold this very folder."""
    found = _git("rev-parse", "--show-toplevel", "HEAD")
    lines = found.split() if found else []
    if len(lines) != 2:
        return None, None
    top, sha = lines
    try:
        if (Path(top) / PACKAGE).resolve() != PACKAGE_DIR:
            return None, None
    except OSError:
        return None, None
    # Untracked files are left out (as setuptools-scm does): a run folder or a scratch file is no change.
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha, (None if status is None else bool(status.strip()))


@functools.cache
def build_info() -> dict[str, Any]:
    """{"version", "commit", "dirty"}: asked once per process (the tree a run started from)."""
    commit, dirty = git_commit()
    return {"version": package_version(), "commit": commit, "dirty": dirty}


def version_line(info: dict[str, Any] | None = None) -> str:
    """`tonpolicy 0.1.0 (commit 1a2b3c4d5e6f, dirty)`; without a commit, `tonpolicy 0.1.0`."""
    info = build_info() if info is None else info
    line = f"{PACKAGE} {info['version'] or 'unknown'}"
    if info["commit"]:
        line += f" (commit {info['commit'][:12]}{', dirty' if info['dirty'] else ''})"
    return line
