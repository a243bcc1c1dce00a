"""One stream of decode (issue 36, item 3): ms per decode step of one request, plain kernels vs the
contract, and the contract with its compiled few-row products off (exact_gemm's torch path, what runs
without a C++ compiler; the same bits). Same model weights, one process, one thread; each round
measures every variant back to back in alternating order (A/B/C, C/B/A), so a shared machine's drift
hits all alike; a ratio is the median over rounds of each round's own ratio. A step's time is the time
of a run of 1 + gen tokens less a prefill-only run, over gen.

    .venv/bin/python experiments/bench_one_stream.py [--models tiny,large] [--dtypes bfloat16,float32]
        [--rounds 5]

Target: contract / plain <= 1.2 per cell (printed; bench_engine.py's one-request rows are the table's).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_engine import MODELS, _requests, _time
from perf_targets import ENGINE_RATIO

from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.invariant import exact_gemv
from tonpolicy.model import Qwen3, init_state_dict

GEN = {"tiny": 32, "large": 16}


def step_ms(model: Qwen3, pre: list, full: list, gen: int, torch_path: bool) -> float:
    saved = exact_gemv.kernel()
    if torch_path:
        exact_gemv._lib[0] = None
    try:
        return (_time(model, full, min_s=0.5) - _time(model, pre, min_s=0.5)) / gen * 1e3
    finally:
        exact_gemv._lib[0] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f}; compiled products: {exact_gemv.kernel() is not None}")
    for name in a.models.split(","):
        for dt in a.dtypes.split(","):
            cfg, work = MODELS[name]
            dtype = getattr(torch, dt)
            sd = init_state_dict(cfg, dtype, seed=0)
            gen = GEN[name]
            pre, full = _requests(cfg, 1, work["prompt"], 1), _requests(cfg, 1, work["prompt"], 1 + gen)
            models = {k: Qwen3(cfg, get_kernels(k), dtype, state_dict=sd) for k in ("plain", "invariant")}
            variants = {"plain": ("plain", False), "contract": ("invariant", False), "torch_path": ("invariant", True)}
            for m in models.values():
                _time(m, full)  # warm-up: every cache the kernels keep
            ms: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(a.rounds):
                for v in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                    kind, torch_path = variants[v]
                    ms[v].append(step_ms(models[kind], pre, full, gen, torch_path))
            ratio = statistics.median(c / p for c, p in zip(ms["contract"], ms["plain"], strict=True))
            ratio_t = statistics.median(c / p for c, p in zip(ms["torch_path"], ms["plain"], strict=True))
            med = {v: statistics.median(t) for v, t in ms.items()}
            rounds = ", ".join(f"{c / p:.2f}" for c, p in zip(ms["contract"], ms["plain"], strict=True))
            print(
                f"{name} {dt}: ms/step plain {med['plain']:.2f}, contract {med['contract']:.2f}, contract torch path "
                f"{med['torch_path']:.2f} | contract/plain {ratio:.2f}x (rounds {rounds}) "
                f"{'pass' if ratio <= ENGINE_RATIO else 'MISS'} | torch path/plain {ratio_t:.2f}x",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
