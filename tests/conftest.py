from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tonpolicy  # noqa: F401  (sets the CPU GEMM settings before any test's first GEMM: tonpolicy.cpu_numerics)

# Tests must not reach W&B's servers.
os.environ.setdefault("WANDB_MODE", "offline")
# Without a GPU the `triton` kernel set runs in Triton's interpreter (set before Triton is imported:
# `triton.jit` reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
