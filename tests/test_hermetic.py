"""The suite passes whatever a user's shell or cluster profile sets (tests/conftest.py scrubs it with
support/hermetic_env.py): a fast subset, run in a fresh pytest under such an environment, passes.
Negative control: unscrubbed, that environment reaches what the subset's fingerprint test reads (a fresh
pytest with the scrub skipped fails that test; checked here in-process, which costs nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.hermetic_env import SCRUBBED_MARK, scrub_environment

from tonpolicy.contract.identity import build_info

ROOT = Path(__file__).resolve().parents[1]
# What a cluster profile may set: instruction-set caps, thread counts, W&B's settings, tonpolicy's hooks.
POLLUTED = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "AVX2",
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "online",
    "WANDB_PROJECT": "x",
    "WANDB_DIR": "/nonexistent/wandb",
    "TONPOLICY_FAULT": "flip_rollout_logprob",
    "TONPOLICY_API_KEY": "a-key-from-the-profile",
    "TONPOLICY_ORDERED_ISA": "portable",
    "TONPOLICY_EXACT_GEMV": "0",
    "TONPOLICY_HOST_CHECK_FAIL": "linear.row_count",
    "NODE_RANK": "1",
}
FINGERPRINT = "tests/kernels/test_cpu_numerics.py::test_fingerprint_build_carries_the_host_path"
SUBSET = [
    FINGERPRINT,
    "tests/kernels/test_cpu_numerics.py::test_hosts_of_another_cpu_class_differ_in_the_runtime_fingerprint",
    "tests/kernels/test_ordered_rowwise.py::test_every_path_is_its_own_build",
    "tests/kernels/test_ordered_rowwise_invariance.py::test_rows_independent_of_batch_position_and_threads",
    "tests/loop/test_step_loop.py::test_a_passing_step_trains_and_syncs",
    "tests/config/test_nodes.py::test_without_a_scheduler_the_environment_names_the_node",
    "tests/config/test_cli.py::test_invalid_config_exits_before_anything_starts",
]


def test_a_fast_subset_passes_in_a_polluted_environment() -> None:
    # A fresh shell's environment (this suite's mark removed) with the profile's variables on top.
    env = {k: v for k, v in os.environ.items() if k != SCRUBBED_MARK} | POLLUTED
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{len(SUBSET)} passed" in done.stdout


def test_the_scrub_is_what_keeps_the_profile_out(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in POLLUTED.items():
        monkeypatch.setenv(k, v)
    assert build_info("cpu")["isa_caps"]  # unscrubbed: the fingerprint test's expected caps are wrong
    env = {k: v for k, v in os.environ.items() if k != SCRUBBED_MARK}
    assert set(scrub_environment(env)) == set(POLLUTED)
    assert env["WANDB_MODE"] == "offline" and not set(POLLUTED) - {"WANDB_MODE"} & set(env)
    kept = {"TONPOLICY_UPDATE_GOLDEN": "1", "TONPOLICY_SGLANG_PYTHON": "/py", SCRUBBED_MARK: "1"}
    assert scrub_environment({**POLLUTED, **kept}) == []  # started by a scrubbed suite: left as the test made it
    env = {**POLLUTED, **kept, SCRUBBED_MARK: "0"}
    scrub_environment(env)
    assert env == {"TONPOLICY_UPDATE_GOLDEN": "1", "TONPOLICY_SGLANG_PYTHON": "/py", SCRUBBED_MARK: "1",
                   "WANDB_MODE": "offline"}  # fmt: skip
