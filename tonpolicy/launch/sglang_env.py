"""Where released SGLang lives and what its server process needs in its environment.

SGLang pins a CUDA build of torch, so it gets an environment of its own (scripts/setup_sglang.sh
makes `.venv-sglang`). With rollout=sglang the trainer runs under the same interpreter, so both
engines compute with one torch build (its version is part of the runtime fingerprint).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tonpolicy.config.rollout_backends import rollout_backend
from tonpolicy.config.schema import Config
from tonpolicy.contract.identity import CONTRACT_ENV

# KV pool on CPU when rollout.max_total_tokens is unset (SGLang would size it from RAM: GBs).
CPU_MAX_TOTAL_TOKENS = 16384
# The pure-torch stand-in for sgl_kernel's CPU ops, put first on PYTHONPATH on CPU only.
CPU_STANDIN_DIR = Path(__file__).resolve().parents[1] / "inside_sglang" / "cpu_standin"


def trainer_python(cfg: Config) -> str:
    """The trainer's interpreter: the one its rollout backend's server needs, or this one."""
    own = rollout_backend(cfg.rollout.backend).interpreter
    return own(cfg) if own is not None else sys.executable


def contract_env(cfg: Config, fingerprint: str) -> str:
    """TONPOLICY_CONTRACT: the contract the model package builds its kernel set from."""

    from tonpolicy.contract.identity import kernel_params

    c = cfg.contract
    return json.dumps(
        {
            "name": c.name,
            "version": c.version,
            "fingerprint": fingerprint,
            "kernels": c.kernels,
            "kernel_params": kernel_params(c),
        },
        sort_keys=True,
    )


def server_environment(cfg: Config, device: str, fingerprint: str) -> dict[str, str]:
    """Environment of the SGLang server process only (the trainer does not get it)."""
    env: dict[str, str] = {}
    if cfg.contract.sglang.model_package:
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = cfg.contract.sglang.model_package
        env[CONTRACT_ENV] = contract_env(cfg, fingerprint)
        # Prompt logprobs as log_softmax, the contract's formula; SGLang's default "fast" path
        # (logit - max - logsumexp) differs in the last bit (measured: tests/sglang/test_sglang_differential.py).
        env["SGLANG_ENABLE_FAST_INPUT_LOGPROBS"] = "0"
    if device == "cpu":
        tp = cfg.parallel.rollout_tp
        cores = max(1, os.cpu_count() or 1)
        env |= {
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": os.pathsep.join([str(CPU_STANDIN_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
            # pynccl would load the CUDA wheel's libnccl and crash on CPU tensors; gloo carries TP.
            "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so",
            # One core set per TP rank (ranks share cores when there are fewer cores than ranks).
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(_cores(r, tp, cores) for r in range(tp)),
            # A stop (SIGTERM to the server's process group) reads to SGLang as a crashed scheduler, and
            # before its crash diagnostics (py-spy, CUDA core dumps) it sleeps 5 s "to let GPU activity
            # settle": a CPU has none to wait for, and every stop and restart would pay it.
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        }
    return env


def _cores(rank: int, ranks: int, cores: int) -> str:
    if ranks >= cores:
        return str(rank % cores)
    per = cores // ranks
    return f"{rank * per}-{rank * per + per - 1}" if per > 1 else str(rank * per)
