"""A hermetic test suite: variables a user's shell or cluster profile may set, which change what the suite
computes (instruction-set caps, thread counts, tonpolicy's fault and test hooks, the node a launcher
thinks it is) or where it reports (W&B), are removed (tests/conftest.py, before torch or tonpolicy is
imported), so the test process and every process a test starts see the same environment on every
machine. Standard library only: it runs before torch loads."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SCRUBBED_PREFIXES = ("TONPOLICY_", "WANDB_", "MKL_", "ONEDNN_", "DNNL_", "OMP_", "KMP_", "GOMP_", "OPENBLAS_")
SCRUBBED_NAMES = frozenset(
    {"ATEN_CPU_CAPABILITY", "NODE_RANK", "SLURM_NODEID", "SUBMITIT_EXECUTOR", "RANK", "LOCAL_RANK", "WORLD_SIZE",
     "MASTER_ADDR", "MASTER_PORT"}
)  # fmt: skip
# Kept when set: the suite's own switches (regenerate golden files, skip the real-SGLang tests, where a
# test writes its report) and where this machine keeps things (the SGLang interpreter, compiled kernels).
KEPT_NAMES = frozenset(
    {"TONPOLICY_UPDATE_GOLDEN", "TONPOLICY_SKIP_SGLANG", "TONPOLICY_MOE_REPORT", "TONPOLICY_SGLANG_PYTHON",
     "TONPOLICY_KERNEL_CACHE"}
)  # fmt: skip
# Set once scrubbed: a pytest a test starts (the instruction-set matrix's cells) inherits this environment
# plus what the test set on purpose, which it keeps.
SCRUBBED_MARK = "TONPOLICY_TEST_ENV_SCRUBBED"


def scrub_environment(env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Remove the user's variables from `env` (unless a scrubbed suite started this one); the names removed."""
    if env.get(SCRUBBED_MARK) == "1":
        return []
    gone = sorted(k for k in env if k not in KEPT_NAMES and (k in SCRUBBED_NAMES or k.startswith(SCRUBBED_PREFIXES)))
    for k in gone:
        del env[k]
    env[SCRUBBED_MARK] = "1"
    env["WANDB_MODE"] = "offline"  # tests must not reach W&B's servers
    return gone
