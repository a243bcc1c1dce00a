"""Released SGLang with tonpolicy's contract model package beside stock SGLang, measured in one run.

    .venv/bin/python experiments/bench/bench_sglang.py [--cells tiny:float32,large:bfloat16] [--rounds 3]
        [--kinds sglang,sglang+contract]

`sglang+contract` is the default `rollout=sglang` job's server: SGLang with
`contract.sglang.model_package=tonpolicy.inside_sglang.model`. `sglang` is stock SGLang on the same
checkpoint: `contract=off_policy` (model package null: SGLang's own Qwen3 and kernels). Both are started with
the command and environment tonpolicy's launch plan renders (which has `--sleep-on-idle` on a CPU),
under the SGLang environment's Python, once per cell (model, dtype), and stay up together. Each is warmed up,
then the same HTTP client sends the same prompts (8 random token ids) with the same sampling params (T=1,
a fixed seed per request, `ignore_eos`, a fixed `max_new_tokens` per model) at 1, 8 and 32 concurrent
streams. Rounds alternate the servers (A/B, then B/A, ...) at each concurrency, because this 2-core machine is
shared: each round's ratio compares two measurements taken back to back.

Prints, per cell and concurrency, the median tokens/s of each server and the ratio contract/stock (median and
min over rounds), checks the targets (>= 1.0x at 8 and 32 concurrent, >= 0.9x at 1), and writes
results/bench_sglang.json. `--kinds` can add `embedded` (tonpolicy's own server, contract kernels) or
`sglang (fp32 LM head)` to the same alternation. Without the SGLang environment (scripts/setup_sglang.sh) it
says so and compares nothing. The defaults take long on a small CPU (the servers start once per cell):
`--rounds 1` or `--cells tiny:float32` for a shorter look.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, round_ratios  # noqa: E402
from perf_targets import SGLANG_RATIO, Check, report  # noqa: E402
from shapes import CPU_1024  # noqa: E402

from tonpolicy.config.compose import compose_config  # noqa: E402
from tonpolicy.config.model import ModelConfig  # noqa: E402
from tonpolicy.config.sglang_rules import sglang_python  # noqa: E402
from tonpolicy.contract.identity import identity  # noqa: E402
from tonpolicy.launch.plan import environment, sglang_argv  # noqa: E402
from tonpolicy.launch.sglang_env import server_environment  # noqa: E402
from tonpolicy.model.checkpoint import init_state_dict, save_hf  # noqa: E402
from tonpolicy.ports import free_port  # noqa: E402
from tonpolicy.rollout.client import RolloutClient  # noqa: E402

MODELS = {
    "tiny": ModelConfig(),
    "large": CPU_1024,
}
# New tokens per request, fixed per model (ignore_eos): about 1-3 s per measurement on a loaded 2-core CPU.
GEN = {"tiny": 64, "large": 24}
CONCURRENCY = (1, 8, 32)
REQUESTS_PER_STREAM = {1: 2, 8: 1, 32: 1}  # one stream sends two requests in turn: a longer measurement
SGLANG_RATIO_ONE_STREAM = 0.9  # contract / stock tokens/s at one stream; SGLANG_RATIO at 8 and 32
STOCK = "sglang"  # contract=off_policy: SGLang's own Qwen3 and kernels
CONTRACT = "sglang+contract"  # the default rollout=sglang job: tonpolicy's model package inside SGLang
# The embedded server under the contract with contract.logits_dtype=bfloat16 (optional kind).
BF16_LOGITS = "embedded (bf16 logits)"
# Stock SGLang with its own `--enable-fp32-lm-head` (optional kind): the logits precision of the contract's
# default contract.logits_dtype=float32 in a bf16 model.
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
            "ordered",
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
    contract = "qwen3_dense_v2" if kind == "sglang+contract" else "off_policy"
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
    n = len(out["output_ids"])
    if n != gen:  # every request must generate the same count, or tokens/s compare different work
        raise RuntimeError(f"{url} generated {n} tokens, asked for {gen} (ignore_eos)")
    return n


def throughput(url: str, vocab: int, streams: int, gen: int, requests_per_stream: int) -> float:
    rng = random.Random(streams)  # the same prompts for every server and round at this concurrency
    prompts = [[rng.randrange(vocab) for _ in range(8)] for _ in range(streams * requests_per_stream)]

    def stream(i: int) -> int:
        return sum(
            generate(url, prompts[i * requests_per_stream + j], gen, i * 1000 + j) for j in range(requests_per_stream)
        )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(stream, range(streams)))
    return tokens / (time.perf_counter() - t0)


class Server:
    """One server process, started from the launch plan's command; stopped by its own process group."""

    def __init__(self, kind: str, ckpt: Path, dtype: str, log: Path) -> None:
        self.kind, self.port = kind, free_port()
        argv, env = server_command(kind, ckpt, dtype, self.port)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
            )
        self.url, self.log = f"http://127.0.0.1:{self.port}", log

    def wait_healthy(self) -> None:
        try:
            RolloutClient(self.url).wait_healthy(600, process=self.proc)
        except Exception as e:
            raise RuntimeError(f"{self.kind} did not start: {e}\n{self.log.read_text()[-3000:]}") from e

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def bench_cell(
    kinds: list[str], ckpt: Path, cfg: ModelConfig, dtype: str, gen: int, rounds: int, tmp: Path
) -> list[dict[str, float]]:
    """tokens/s of each `kind@concurrency`, one dict per round (every kind and concurrency alternated)."""
    servers = [Server(k, ckpt, dtype, tmp / f"{cfg.name}_{dtype}_{k.replace(' ', '_')}.log") for k in kinds]
    try:
        for s in servers:  # started together (startup overlaps), warmed up one by one
            s.wait_healthy()
        for s in servers:
            for c in CONCURRENCY:  # every batch shape once: first-call costs stay out of the rounds
                throughput(s.url, cfg.vocab_size, c, 4, 1)
        by_kind = {s.kind: s for s in servers}

        def measure(cell: str, _round: int) -> float:
            kind, c = cell.rsplit("@", 1)
            return throughput(by_kind[kind].url, cfg.vocab_size, int(c), gen, REQUESTS_PER_STREAM[int(c)])

        return alternate([f"{k}@{c}" for c in CONCURRENCY for k in kinds], rounds, measure)
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="tiny:float32,large:bfloat16", help="model:dtype pairs (models: tiny, large)")
    ap.add_argument("--kinds", default=f"{STOCK},{CONTRACT}", help="servers; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round, tiny fp32 (perf_report.py keeps the other rows)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.cells = 1, "tiny:float32"
    sys.stdout.reconfigure(line_buffering=True)  # each cell's table as it is measured (runs take minutes)
    py = sglang_python(compose_config(["rollout=sglang"]))
    if subprocess.run([py, "-c", "import sglang"], capture_output=True).returncode != 0:
        print(f"SKIPPED: no SGLang environment at {py} (run `bash scripts/setup_sglang.sh` to compare with it)")
        report("bench_sglang", [], {"skipped": f"no SGLang environment at {py}"})
        return
    kinds = args.kinds.split(",")
    base = kinds[0]
    checks: list[Check] = []
    cells: dict[str, Any] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for cell in args.cells.split(","):
            name, dtype = cell.split(":")
            cfg, gen = MODELS[name], GEN[name]
            short = "bf16" if dtype == "bfloat16" else "fp32"
            ckpt = Path(tmp) / f"{name}_{dtype}"
            save_hf(init_state_dict(cfg, getattr(torch, dtype), 0), cfg, ckpt)
            per_round = bench_cell(kinds, ckpt, cfg, dtype, gen, args.rounds, Path(tmp))
            runs = {k: {c: [r[f"{k}@{c}"] for r in per_round] for c in CONCURRENCY} for k in kinds}
            ratios = {k: {c: round_ratios(per_round, f"{k}@{c}", f"{base}@{c}") for c in CONCURRENCY} for k in kinds}
            cells[f"{name}/{short}"] = {
                "hidden": cfg.hidden_size,
                "layers": cfg.num_layers,
                "gen": gen,
                "tok_s": runs,
                "ratio_to_" + base: {k: v for k, v in ratios.items() if k != base},
            }
            print(
                f"\n{name} (hidden {cfg.hidden_size}, {cfg.num_layers} layers), {dtype}, 8-token prompts, "
                f"{gen} new tokens, {args.rounds} alternated rounds: median tokens/s; ratio to {base} median (min)"
            )
            print("| server | " + " | ".join(f"{c} concurrent" for c in CONCURRENCY) + " |")
            print("|---|" + "---|" * len(CONCURRENCY))
            for k in kinds:
                cols = []
                for c in CONCURRENCY:
                    tok = statistics.median(runs[k][c])
                    rs = ratios[k][c]
                    cols.append(
                        f"{tok:.0f}" + ("" if k == base else f" ({statistics.median(rs):.2f}x ({min(rs):.2f}x))")
                    )
                print(f"| {k} | " + " | ".join(cols) + " |")
            for k in kinds[1:]:
                for c in CONCURRENCY:
                    checks.append(
                        Check(
                            f"{k} / {base} tok/s, {name} {short}, {c} concurrent",
                            statistics.median(ratios[k][c]),
                            SGLANG_RATIO_ONE_STREAM if c == 1 else SGLANG_RATIO,
                            at_most=False,
                        )
                    )
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s")
    report("bench_sglang", checks, {"prompt_tokens": 8, "rounds": args.rounds, "baseline": base, "cells": cells})


if __name__ == "__main__":
    main()
