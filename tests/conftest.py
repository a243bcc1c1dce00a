from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.hermetic_env import scrub_environment

# Before torch or tonpolicy is imported: the user's instruction-set caps, thread counts, hooks and W&B
# settings never reach the suite (support/hermetic_env.py).
SCRUBBED = scrub_environment()

import torch  # noqa: E402 - after the scrub: its OpenMP runtime reads the thread count when it loads

from tonpolicy.cpu_memory import tune_malloc  # noqa: E402

# The command line's heap settings (tonpolicy.cpu_memory): the suite's in-process models run as jobs do.
tune_malloc()

# Without a GPU the `triton` kernel set runs in Triton's interpreter (set before Triton is imported:
# `triton.jit` reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
# Markers given by a test's folder (pyproject.toml lists them all).
FOLDER_MARKERS = {"e2e": "e2e", "sglang": "sglang"}


def pytest_report_header() -> str | None:
    return f"environment scrubbed of: {', '.join(SCRUBBED)}" if SCRUBBED else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.fspath).resolve().relative_to(ROOT / "tests").parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])


@pytest.fixture(scope="session", autouse=True)
def host_check() -> None:
    """Once per test session: the contract's invariances on this host (tonpolicy.kernels.invariant.host_check) at
    the default job's shapes and fp32; a host that fails them cannot pass the parity tests, so say why
    first."""
    from tonpolicy.config.compose import compose_config
    from tonpolicy.contract.host import host_problems

    if os.environ.get("TONPOLICY_HOST_CHECK_FAIL"):
        return  # a test of the refusal path runs under a forced failure
    for dtype in ("bfloat16", "float32"):
        cfg = compose_config([f"contract.dtype={dtype}"])
        problems = host_problems(cfg.model, cfg.contract)
        if problems:
            pytest.exit("\n".join(problems), returncode=3)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
