"""`rollout=sglang` with the triton kernel set (contract=qwen3_dense_triton_v1): accepted on CUDA, with the
SGLang command it needs (SGLang's own parser accepts it); on a CPU only in Triton's interpreter (tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.plan import TRITON_MEM_FRACTION_STATIC, sglang_argv
from tonpolicy.validation.validate import ConfigError, validate

TRITON_SGLANG = ["mode=plan", "rollout=sglang", "contract=qwen3_dense_triton_v1", "trainer.device=cuda"]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_triton_set_through_sglang_is_accepted_on_cuda() -> None:
    cfg = compose_config(TRITON_SGLANG)
    validate(cfg)
    argv = sglang_argv(cfg, "/ckpt", "cuda")
    assert argv[1:3] == ["-m", "tonpolicy.inside_sglang.server"]  # the model package runs the kernels
    assert _flag(argv, "--attention-backend") == "triton" and "--device" not in argv
    # Decode in CUDA graphs (one per batch-size bucket up to the running requests), prefill eager.
    assert _flag(argv, "--cuda-graph-backend-decode") == "full" and "--disable-cuda-graph" not in argv
    assert _flag(argv, "--cuda-graph-max-bs-decode") == str(cfg.rollout.max_running_requests)
    assert _flag(argv, "--cuda-graph-backend-prefill") == "disabled"
    assert _flag(argv, "--mem-fraction-static") == str(TRITON_MEM_FRACTION_STATIC)  # the trainer shares the GPU
    # The user's choices win.
    mine = sglang_argv(
        compose_config([*TRITON_SGLANG, "rollout.mem_fraction_static=0.7", "contract.sglang.attention_backend=fa3"]),
        "/ckpt",
        "cuda",
    )
    assert _flag(mine, "--mem-fraction-static") == "0.7" and mine.count("--mem-fraction-static") == 1
    assert _flag(mine, "--attention-backend") == "fa3"
    # The invariant set on CUDA keeps graphs off (it sizes its GEMMs on the host).
    invariant = sglang_argv(compose_config(["rollout=sglang", "trainer.device=cuda"]), "/ckpt", "cuda")
    assert "--disable-cuda-graph" in invariant and "--cuda-graph-backend-decode" not in invariant
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "support" / "sglang_argcheck.py")],
        input=json.dumps([argv[3:], mine[3:]]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["ok"] for r in results) and results[0]["attention_backend"] == "triton", results


def test_triton_set_on_a_cpu_only_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ["mode=plan", "rollout=sglang", "contract=qwen3_dense_triton_v1", "trainer.device=cpu"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides))
    assert "trainer.device='cpu': contract qwen3_dense_triton_v1 runs Triton kernels on CUDA GPUs" in str(info.value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # tests (tests/sglang/test_sglang_triton.py)
    validate(compose_config(overrides))
