"""Rollout servers side by side on this machine: stock SGLang, SGLang with tonpolicy's contract model
package, and tonpolicy's embedded server (contract kernels), on the same checkpoint and workload.

    .venv/bin/python experiments/bench_sglang.py [--models tiny,large] [--dtypes bfloat16,float32] [--gen 128]

Each server is started with the command and environment tonpolicy's launch plan renders (all under
the SGLang environment's Python, so they share one torch build), warmed up, then driven by the same
HTTP client at 1, 8 and 32 concurrent streams (8-token prompts, `--gen` new tokens, sampling at T=1;
the median of 3 rounds per cell).
Prints tokens/s per server and concurrency and the ratios against stock SGLang, measured in one run,
and the target (embedded server with contract kernels >= 1.0x stock SGLang) as measured / target, in
bf16 also against stock SGLang with `--enable-fp32-lm-head` (the contract's default logits precision);
results/bench_sglang.json gets the numbers. Without the SGLang environment (scripts/setup_sglang.sh) it
says so and compares nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from bench_models import CPU_1024
from perf_targets import SGLANG_RATIO, Check, report

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.config.sglang_rules import sglang_python
from tonpolicy.contract.identity import identity
from tonpolicy.launch.plan import environment, sglang_argv
from tonpolicy.launch.sglang_env import server_environment
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.ports import free_port
from tonpolicy.rollout.client import RolloutClient

MODELS = {
    "tiny": ModelConfig(),
    "large": CPU_1024,
}
CONCURRENCY = (1, 8, 32)
# Requests each stream sends in turn (one stream: about 1.5 s of work per measurement), and rounds.
REQUESTS_PER_STREAM = {1: 4, 8: 2, 32: 1}
ROUNDS = 3
# The embedded server under the contract with contract.logits_dtype=bfloat16: logits from the native bf16
# GEMM, the precision stock SGLang's LM head has (measured beside the default fp32 logits, bf16 only).
BF16_LOGITS = "embedded (bf16 logits)"
# Stock SGLang with its own `--enable-fp32-lm-head`: the logits precision the contract's default
# (contract.logits_dtype=float32) gives, so the like-for-like baseline for it (bf16 only; an fp32 model's
# LM head is fp32 anyway).
FP32_LM_HEAD = "sglang (fp32 LM head)"


def server_command(
    kind: str, ckpt: Path, dtype: str, port: int, text: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The server's command and the environment a launched job gives it (the launch plan's process
    environment, plus SGLang's own); `text`: load the checkpoint's tokenizer (text API)."""
    if kind.startswith("embedded"):
        logits = ["contract.logits_dtype=bfloat16"] if kind == BF16_LOGITS else []
        cfg = compose_config([f"contract.dtype={dtype}", *logits])
        ident = identity(cfg.contract)
        argv = [
            sglang_python(compose_config(["rollout=sglang"])),
            "-m",
            "tonpolicy.rollout.server",
            "--model-path",
            str(ckpt),
            "--kernels",
            "invariant",
            "--dtype",
            dtype,
            "--port",
            str(port),
            "--contract-name",
            ident.name,
            "--contract-version",
            str(ident.version),
            "--contract-fingerprint",
            ident.fingerprint,
            "--max-running-requests",
            "32",
            *(["--logits-dtype", "bfloat16"] if kind == BF16_LOGITS else []),
        ]
        return argv + ([] if text else ["--skip-tokenizer-init"]), environment(cfg, "cpu")
    contract = "qwen3_dense_v1" if kind == "sglang+contract" else "off_policy"
    cfg = compose_config(
        [
            f"contract={contract}",
            f"contract.dtype={dtype}",
            "rollout=sglang",
            "trainer.device=cpu",
            "rollout.max_running_requests=32",
            f"rollout.skip_tokenizer_init={not text}",
        ]
    )
    argv = sglang_argv(cfg, str(ckpt), "cpu", port) + (["--enable-fp32-lm-head"] if kind == FP32_LM_HEAD else [])
    return argv, {**environment(cfg, "cpu"), **server_environment(cfg, "cpu", identity(cfg.contract).fingerprint)}


def generate(url: str, prompt: list[int], gen: int, seed: int) -> int:
    body = {
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": gen,
            "temperature": 1.0,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
    }
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
    return len(out["output_ids"])


def throughput(url: str, vocab: int, streams: int, gen: int, requests_per_stream: int) -> float:
    rng = random.Random(streams)
    prompts = [[rng.randrange(vocab) for _ in range(8)] for _ in range(streams * requests_per_stream)]

    def stream(i: int) -> int:
        return sum(
            generate(url, prompts[i * requests_per_stream + j], gen, i * 1000 + j) for j in range(requests_per_stream)
        )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(stream, range(streams)))
    return tokens / (time.perf_counter() - t0)


def bench_server(kind: str, ckpt: Path, cfg: ModelConfig, dtype: str, gen: int, log: Path) -> dict[int, float]:
    port = free_port()
    argv, env = server_command(kind, ckpt, dtype, port)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        RolloutClient(url).wait_healthy(600, process=proc)
        throughput(url, cfg.vocab_size, 2, 8, 1)  # warm-up
        # ROUNDS rounds over the concurrencies, the median of each: one scheduler hiccup on a shared
        # machine moved single measurements by 0.1-0.3x.
        runs = {c: [] for c in CONCURRENCY}
        for _ in range(ROUNDS):
            for c in CONCURRENCY:
                runs[c].append(throughput(url, cfg.vocab_size, c, gen, REQUESTS_PER_STREAM[c]))
        return {c: statistics.median(r) for c, r in runs.items()}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--gen", type=int, default=128)
    args = ap.parse_args()
    py = sglang_python(compose_config(["rollout=sglang"]))
    if subprocess.run([py, "-c", "import sglang"], capture_output=True).returncode != 0:
        print(f"SKIPPED: no SGLang environment at {py} (run `bash scripts/setup_sglang.sh` to compare with it)")
        report("bench_sglang", [], {"skipped": f"no SGLang environment at {py}"})
        return
    base_kinds = ("sglang", "sglang+contract", "embedded")
    checks, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            short = "bf16" if dtype == "bfloat16" else "fp32"
            kinds = base_kinds + ((BF16_LOGITS, FP32_LM_HEAD) if dtype == "bfloat16" else ())
            for name in args.models.split(","):
                cfg = MODELS[name]
                ckpt = Path(tmp) / f"{name}_{dtype}"
                save_hf(init_state_dict(cfg, getattr(torch, dtype), 0), cfg, ckpt)
                results = {
                    k: bench_server(k, ckpt, cfg, dtype, args.gen, Path(tmp) / f"{name}_{k.replace(' ', '_')}.log")
                    for k in kinds
                }
                runs[f"{name}/{short}"] = results
                print(
                    f"\n{name} (hidden {cfg.hidden_size}, {cfg.num_layers} layers), {dtype}, "
                    f"8-token prompts, {args.gen} new tokens: tokens/s (ratio to stock SGLang)"
                )
                print("| server | " + " | ".join(f"{c} concurrent" for c in CONCURRENCY) + " |")
                print("|---|" + "---|" * len(CONCURRENCY))
                for k in kinds:
                    cells = [f"{results[k][c]:.0f} ({results[k][c] / results['sglang'][c]:.2f}x)" for c in CONCURRENCY]
                    print(f"| {k} | " + " | ".join(cells) + " |")
                for kind, label, base, base_label in (
                    ("embedded", "embedded (contract)", "sglang", "stock SGLang"),
                    (BF16_LOGITS, "embedded (contract, bf16 logits)", "sglang", "stock SGLang"),
                    ("embedded", "embedded (contract)", FP32_LM_HEAD, "stock SGLang --enable-fp32-lm-head"),
                ):
                    for c in CONCURRENCY if kind in results and base in results else ():
                        checks.append(
                            Check(
                                f"{label} / {base_label} tok/s, {name} {short}, {c} concurrent",
                                results[kind][c] / results[base][c],
                                SGLANG_RATIO,
                                at_most=False,
                            )
                        )
    report("bench_sglang", checks, {"gen": args.gen, "prompt_tokens": 8, "tok_s": runs})


if __name__ == "__main__":
    main()
