"""docs/guides/sglang_integration.md's recipe, run: released SGLang started by its own launcher
(examples/integration/sglang_server.py, as slime starts it) and SGLang's in-process engine
(sglang_engine.py, as verl runs it), each given only what tonpolicy.api renders and tonpolicy's SGLang
plugin, sample a response whose logprobs a plain megatron-core GPTModel built from the contract
(megatron_gpt.py, tonpolicy's trainer recipe) reproduces bit for bit. Negative control: the same request
sent to stock SGLang (the folder's off-policy server: SGLang's own Qwen3, kernels and sampler) is scored
with mismatches. The two examples run at once, on the folder's tiny fp32 checkpoint."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.sglang_proc import SGLangServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "integration"
OVERRIDES = ["contract=qwen3_dense_v2", "contract.dtype=float32"]


def _example(name: str):  # noqa: ANN202 - the example's module
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stock_sample(server: SGLangServer) -> dict:
    """The server example's request, answered by stock SGLang."""
    example = _example("sglang_server")
    return example.generate(server.url, example.PROMPT) | {"sampled_by": "stock SGLang"}


def test_released_sglang_started_by_itself_gives_the_trainers_bits(
    tmp_path: Path, sglang_py: str, fp32_ckpt: Path, stock_fp32_server: SGLangServer
) -> None:
    runs = {
        name: subprocess.Popen(
            [sglang_py, str(EXAMPLES / f"{name}.py"), str(fp32_ckpt), str(tmp_path / f"{name}.json"), *OVERRIDES],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for name in ("sglang_server", "sglang_engine")
    }
    samples = []
    for name, run in runs.items():
        log, _ = run.communicate(timeout=600)
        assert run.returncode == 0, f"{name}:\n{log[-4000:]}"
        samples += json.loads((tmp_path / f"{name}.json").read_text())
    samples.append(_stock_sample(stock_fp32_server))
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    scored = subprocess.run(
        [sys.executable, str(EXAMPLES / "megatron_gpt.py"), str(fp32_ckpt), str(tmp_path / "samples.json"), *OVERRIDES],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert scored.returncode == 0, scored.stderr[-4000:]
    reports = {r["sampled_by"]: r for r in map(json.loads, scored.stdout.strip().splitlines())}
    print(reports)
    for by in ("sglang.launch_server", "sglang.Engine"):
        assert reports[by]["tokens_scored"] == 32 and reports[by]["mismatched_tokens"] == 0, reports[by]
        assert reports[by]["max_abs_logprob_diff"] == 0.0
    stock = reports["stock SGLang"]
    assert stock["tokens_scored"] == 32 and stock["mismatched_tokens"] > 0, stock


@pytest.mark.parametrize("package", [None, "someone.elses.models"])
def test_the_plugin_leaves_other_models_alone(monkeypatch: pytest.MonkeyPatch, package: str | None) -> None:
    """SGLang runs tonpolicy's plugin in every process of its environment: unless the process serves
    tonpolicy's model package it registers nothing (it does not even load the sampler's module)."""
    from tonpolicy.inside_sglang import plugin

    if package is None:
        monkeypatch.delenv(plugin.MODEL_PACKAGE_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.MODEL_PACKAGE_ENV, package)
    plugin.register()
    assert "tonpolicy.inside_sglang.model.heads" not in sys.modules
    assert plugin.MODEL_PACKAGE == "tonpolicy.inside_sglang.model"
