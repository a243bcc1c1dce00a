"""SGLang's own benchmark client and the official OpenAI client against the embedded server, each run
from the SGLang environment exactly as a user would (tests/support/sglang_proc.py finds it)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.server_proc import DTYPE, IDENTITY, ServerProc, save_checkpoint
from support.sglang_proc import ROOT, sglang_env_python
from support.text_api import call, with_chat_template

PROMPTS, INPUT_LEN, OUTPUT_LEN = 16, 16, 8


@pytest.fixture(scope="module")
def sglang_py() -> str:
    return sglang_env_python()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=4))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[str]:
    args = ["--model-path", str(ckpt), "--dtype", DTYPE, "--max-running-requests", "8", *IDENTITY]
    srv = ServerProc(tmp_path_factory.mktemp("server"), "embedded", args)
    srv.start_healthy()
    yield f"http://127.0.0.1:{srv.port}"
    assert srv.stop() == 0, srv.log()


def run_client(argv: list[str]) -> subprocess.CompletedProcess:
    # Offline: the clients must find everything on this machine (the checkpoint's tokenizer).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def test_sglang_bench_serving_completes(tmp_path: Path, sglang_py: str, url: str, ckpt: Path) -> None:
    out = tmp_path / "bench.jsonl"
    proc = run_client([
        sglang_py, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
        "--dataset-name", "random-ids", "--num-prompts", str(PROMPTS), "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1.0", "--request-rate", "inf",
        "--max-concurrency", "4", "--tokenizer", str(ckpt), "--output-file", str(out),
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(out.read_text().splitlines()[-1])
    # Every request streamed to its full length (bench_serving sends ignore_eos), text prompts or ids.
    assert result["completed"] == PROMPTS and result["total_output_tokens"] == PROMPTS * OUTPUT_LEN, result
    assert result["total_input_tokens"] == PROMPTS * INPUT_LEN
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0  # timings come from streamed chunks
    assert result["server_info"]["internal_states"][0]["largest_batch"] > 1  # concurrent requests batched


def test_openai_client_completes(sglang_py: str, url: str, ckpt: Path) -> None:
    proc = run_client([sglang_py, str(ROOT / "tests" / "support" / "openai_client_check.py"), url])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    _, native = call(url, "/generate", {"text": "copy 1 2 3", "sampling_params": params, "return_logprob": True})
    assert got["model"] == str(ckpt)
    assert got["text"] == native["text"] == got["streamed_text"] and got["finish_reason"] == "length"
    assert got["token_logprobs"] == [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]
    assert all(len(top) == 2 for top in got["top_logprobs"])
    assert got["usage"]["completion_tokens"] == 5
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    _, chat = call(url, "/generate", {"text": "user : copy 1 2 say", "sampling_params": params})
    assert got["chat"] == chat["text"]
