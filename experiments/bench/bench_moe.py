"""What the MoE contract costs in the embedded engine: `ordered` (qwen3_moe_v2's ops) vs `plain`
kernels on qwen3_moe_tiny, prefill and decode tokens/s, bf16 and fp32, measured side by side in one
run (the two kernel sets alternate over `--repeats` rounds, experiments/alternate.py). Ratios are
contract time / plain time (>1: the contract is slower). Writes results/bench_moe.json.

    .venv/bin/python experiments/bench/bench_moe.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, median_of, median_ratio  # noqa: E402
from perf_targets import RESULTS  # noqa: E402

from tonpolicy.config.compose import compose_config  # noqa: E402
from tonpolicy.kernels import get_kernels  # noqa: E402
from tonpolicy.model.checkpoint import init_state_dict  # noqa: E402
from tonpolicy.model.qwen3_moe import Qwen3Moe  # noqa: E402
from tonpolicy.rollout.engine import Engine, GenRequest  # noqa: E402

WORKLOAD = dict(requests=8, prompt=128, gen=16)


def _requests(vocab: int, gen: int) -> list[GenRequest]:
    rng = random.Random(0)
    n, p = WORKLOAD["requests"], WORKLOAD["prompt"]
    return [GenRequest([rng.randrange(vocab) for _ in range(p)], gen, seed=i) for i in range(n)]


def _seconds(model: Qwen3Moe, reqs: list[GenRequest]) -> float:
    t0 = time.perf_counter()
    Engine(model, max_running_requests=len(reqs)).generate(reqs)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose_config(["model=qwen3_moe_tiny"]).model
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        sd = init_state_dict(cfg, dtype, 0)
        models = {k: Qwen3Moe(cfg, get_kernels(k), dtype, sd) for k in ("ordered", "plain")}
        prefill, full = _requests(cfg.vocab_size, 1), _requests(cfg.vocab_size, 1 + WORKLOAD["gen"])
        for m in models.values():  # warm-up
            _seconds(m, prefill)

        def measure(k: str, _round: int, prefill: list = prefill, full: list = full, models: dict = models) -> dict:
            p = _seconds(models[k], prefill)
            return {"prefill": p, "decode": max(_seconds(models[k], full) - p, 1e-9)}

        rounds = alternate(list(models), args.repeats, measure)
        n = WORKLOAD["requests"]
        for phase, tokens in (("prefill", n * WORKLOAD["prompt"]), ("decode", n * WORKLOAD["gen"])):
            med = {k: median_of(rounds, k, lambda x, phase=phase: x[phase]) for k in models}
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "phase": phase,
                    "contract_tok_s": tokens / med["ordered"],
                    "plain_tok_s": tokens / med["plain"],
                    "ratio": median_ratio(rounds, "ordered", "plain", lambda x, phase=phase: x[phase]),
                }
            )
    print(f"qwen3_moe_tiny, {WORKLOAD}, {args.threads} thread(s), {platform.processor() or platform.machine()}")
    print("| dtype | phase | contract tok/s | plain tok/s | contract / plain time |")
    print("|---|---|---|---|---|")
    for r in rows:
        tok = f"{r['contract_tok_s']:.0f} | {r['plain_tok_s']:.0f}"
        print(f"| {r['dtype']} | {r['phase']} | {tok} | {r['ratio']:.2f}x |")
    out = RESULTS / "bench_moe.json"
    out.write_text(json.dumps({"workload": WORKLOAD, "threads": args.threads, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
