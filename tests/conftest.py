from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests must not reach W&B's servers.
os.environ.setdefault("WANDB_MODE", "offline")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
