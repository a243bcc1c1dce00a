"""SGLang's own benchmark client (`sglang.bench_serving --backend sglang`) against three servers on
one checkpoint: stock SGLang, SGLang with tonpolicy's contract model package, and tonpolicy's
embedded server (contract kernels). Every server is started with the command and environment
tonpolicy renders (tokenizer loaded, all under the SGLang environment's Python, one torch build),
then driven with the same random-ids workload at each concurrency, one after the other.

    .venv/bin/python experiments/bench/bench_serving_table.py [--dtype float32] [--prompts 64] [--input 64]
        [--output 64]

Prints a markdown table (output tokens/s, mean TTFT, mean ITL; ratios to stock SGLang) and writes it
with the raw bench_serving results to experiments/results/bench_serving_cpu.{md,json}.
Needs the SGLang environment (scripts/setup_sglang.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from bench_sglang import server_command  # noqa: E402

from tonpolicy.config.compose import compose_config  # noqa: E402
from tonpolicy.config.model import ModelConfig  # noqa: E402
from tonpolicy.config.sglang_rules import sglang_python  # noqa: E402
from tonpolicy.model.checkpoint import init_state_dict, save_hf  # noqa: E402
from tonpolicy.ports import free_port  # noqa: E402
from tonpolicy.rollout.client import RolloutClient  # noqa: E402

KINDS = ("sglang", "sglang+contract", "embedded")
RESULTS = Path(__file__).resolve().parents[1] / "results"


def bench(py: str, url: str, ckpt: Path, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    argv = [
        py, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
        "--dataset-name", "random-ids", "--num-prompts", str(args.prompts), "--random-input-len", str(args.input),
        "--random-output-len", str(args.output), "--random-range-ratio", "1.0", "--request-rate", "inf",
        "--max-concurrency", str(concurrency), "--tokenizer", str(ckpt), "--output-file", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"bench_serving failed against {url}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text().splitlines()[-1])


def run_server(kind: str, py: str, ckpt: Path, tmp: Path, args: argparse.Namespace) -> dict[int, dict]:
    port = free_port()
    argv, env = server_command(kind, ckpt, args.dtype, port, text=True)
    with open(tmp / f"{kind}.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        RolloutClient(url).wait_healthy(600, process=proc)
        return {c: bench(py, url, ckpt, c, args, tmp / f"{kind}_{c}.jsonl") for c in args.concurrency}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def table(results: dict[str, dict[int, dict]], args: argparse.Namespace) -> str:
    lines = [
        f"`sglang.bench_serving --backend sglang`, random-ids, {args.prompts} prompts of {args.input} tokens, "
        f"{args.output} new tokens each (ignore_eos), {args.dtype}, tiny Qwen3 (tonpolicy's default profile), "
        f"this 2-core CPU. Ratio: to stock SGLang at the same concurrency.",
        "",
        "| server | concurrency | output tok/s | mean TTFT ms | mean ITL ms | mean TPOT ms |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        for c, r in results[kind].items():
            base = results["sglang"][c]
            ratio = r["output_throughput"] / base["output_throughput"]
            lines.append(
                f"| {kind} | {c} | {r['output_throughput']:.0f} ({ratio:.2f}x) | {r['mean_ttft_ms']:.1f} | "
                f"{r['mean_itl_ms']:.1f} | {r['mean_tpot_ms']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8])
    args = ap.parse_args()
    py = sglang_python(compose_config(["rollout=sglang"]))
    if subprocess.run([py, "-c", "import sglang"], capture_output=True).returncode != 0:
        sys.exit(f"no SGLang environment at {py}: run `bash scripts/setup_sglang.sh` first")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny"
        cfg = ModelConfig()
        save_hf(init_state_dict(cfg, getattr(torch, args.dtype), 0), cfg, ckpt)
        results = {kind: run_server(kind, py, ckpt, Path(tmp), args) for kind in KINDS}
    text = table(results, args)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_serving_cpu.md").write_text(text + "\n")
    (RESULTS / "bench_serving_cpu.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
