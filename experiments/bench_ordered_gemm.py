"""The ordered GEMM (contract v2, tonpolicy.kernels.invariant.ordered_gemm) against torch's own products.

Prints, per dtype, shape (K x N of the weight) and row count, the time of `ordered_gemm.linear` over the
time of `F.linear` (oneDNN / MKL) on the same operands: the median over alternated rounds (each round
times both, in turns, so a noisy neighbour hits both alike), both measured in this one run. Then the
attention's batched products: `ordered_gemm.bmm` over `torch.bmm`.

    .venv/bin/python experiments/bench_ordered_gemm.py [--threads 2] [--rounds 7] [--min-ms 20]

A ratio below 1 means the ordered product is faster. Measure on a quiet host: on 2 vCPUs a second busy
process quantises 2-thread calls into scheduler slices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tonpolicy.kernels.invariant import ordered_gemm

SHAPES = [(1024, 3072), (3072, 1024), (1024, 1024), (64, 192)]  # K x N
ROWS = [1, 4, 64, 512]
BMM_SHAPES = [(64, m, k, n) for m in (1, 16, 64) for k, n in ((128, 32), (32, 128))]  # B, M, K, N


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _reps(fn: Callable[[], object], min_s: float) -> int:
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    return max(1, int(min_s / one))


def _timed(fn: Callable[[], object], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def compare(ours: Callable[[], object], theirs: Callable[[], object], rounds: int, min_s: float):
    """(median seconds ours, median seconds theirs, median of the per-round ratios)."""
    ours(), theirs()  # warm: packed weight, allocator, thread pool
    reps_a, reps_b = _reps(ours, min_s), _reps(theirs, min_s)
    ta, tb, ratio = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            a, b = _timed(ours, reps_a), _timed(theirs, reps_b)
        else:
            b, a = _timed(theirs, reps_b), _timed(ours, reps_a)
        ta.append(a)
        tb.append(b)
        ratio.append(a / b)
    return statistics.median(ta), statistics.median(tb), statistics.median(ratio)


def _us(s: float) -> str:
    return f"{s * 1e6:9.1f}" if s < 0.1 else f"{s * 1e3:7.1f}ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-ms", type=float, default=20.0, help="time per variant per round (at least one call)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--no-bmm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    min_s = args.min_ms / 1e3
    print(f"# ordered GEMM vs torch: {cpu_model()}, {args.threads} threads, torch {torch.__version__}, ")
    print(f"# path {ordered_gemm.chosen_path()}, {args.rounds} alternated rounds, load {os.getloadavg()[0]:.2f}")
    print("# ratio = ordered time / torch time (median of rounds); times in us per call")
    print(f"{'dtype':9} {'K x N':>11} {'M':>4} {'ordered':>10} {'torch':>10} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        for k, n in SHAPES:
            w = torch.randn(n, k, generator=g).to(dt)
            for m in ROWS:
                x = torch.randn(m, k, generator=g).to(dt)
                a, b, r = compare(
                    lambda x=x, w=w: ordered_gemm.linear(x, w), lambda x=x, w=w: F.linear(x, w), args.rounds, min_s
                )
                print(f"{name:9} {f'{k}x{n}':>11} {m:>4} {_us(a):>10} {_us(b):>10} {r:6.2f}", flush=True)
    if args.no_bmm:
        return
    print(f"\n{'bmm dtype':9} {'B,M,K,N':>14} {'ordered':>10} {'torch':>10} {'ratio':>6}")
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        for bsz, m, k, n in BMM_SHAPES:
            a_ = torch.randn(bsz, m, k, generator=g).to(dt)
            b_ = torch.randn(bsz, k, n, generator=g).to(dt)
            a, b, r = compare(
                lambda a_=a_, b_=b_: ordered_gemm.bmm(a_, b_),
                lambda a_=a_, b_=b_: torch.bmm(a_, b_),
                args.rounds,
                min_s,
            )
            shape = f"{bsz},{m},{k},{n}"
            print(f"{name:9} {shape:>14} {_us(a):>10} {_us(b):>10} {r:6.2f}", flush=True)


if __name__ == "__main__":
    main()
