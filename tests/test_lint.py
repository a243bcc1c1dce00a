"""The tree stays `ruff` clean and `ruff format`ted (rules and line length in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path


def test_ruff_clean() -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "tonpolicy", "tests", "experiments"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_clean() -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "tonpolicy", "tests", "experiments"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
