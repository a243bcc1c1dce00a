"""What the contract GEMM costs (tonpolicy.kernels.invariant.exact_gemm), measured side by side in one run: the
contract's linear (exact fixed-point, fp64) against plain `F.linear` and against the strategy it replaced
(library GEMMs in fixed row tiles: 512-row tiles and a tail padded to 4 rows, whose bits rest on how MKL
and oneDNN happen to block on the measured CPU), at decode and prefill row counts, bf16 and fp32, the tiny
and the hidden-1024 model's shapes. Each cell is the median of alternated rounds.

    .venv/bin/python experiments/bench_gemm.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tonpolicy.contract.identity import build_info
from tonpolicy.cpu_numerics import describe_host
from tonpolicy.kernels import get_kernels

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"tiny qkv": (128, 256), "tiny down": (384, 128), "large up": (1024, 3072), "large down": (3072, 1024)}
ROWS = (1, 4, 64, 512)


def tiled_library(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The replaced strategy: library GEMMs of 512-row tiles, the tail zero-padded to a multiple of 4."""
    m, k = x.shape
    big = m // 512 * 512
    parts = [torch.mm(x[a : a + 512], w.t()) for a in range(0, big, 512)]
    if m > big:
        tail = x[big:]
        pad = -tail.shape[0] % 4
        parts.append(torch.mm(F.pad(tail, (0, 0, 0, pad)), w.t())[: tail.shape[0]])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def timed(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    k = get_kernels("invariant")
    rows = []
    print(f"host: {describe_host()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'shape':>11} {'dtype':>9} {'M':>4}  {'plain ms':>9}  {'contract/plain':>14}  {'tiled/plain':>11}")
    with torch.no_grad():
        for name, (kk, n) in SHAPES.items():
            for dtype in (torch.bfloat16, torch.float32):
                w = (torch.randn(n, kk) * kk**-0.5).to(dtype)
                for m in ROWS:
                    x = torch.randn(m, kk).to(dtype)
                    reps = max(3, int(2e8 / (m * kk * n + 1e6)))
                    sides = {
                        "plain": lambda x=x, w=w: F.linear(x, w),
                        "contract": lambda x=x, w=w: k.linear(x, w),
                        "tiled": lambda x=x, w=w: tiled_library(x, w),
                    }
                    times: dict[str, list[float]] = {s: [] for s in sides}
                    for _ in range(args.rounds):
                        for s, fn in sides.items():
                            times[s].append(timed(fn, reps))
                    med = {s: statistics.median(v) for s, v in times.items()}
                    row = {
                        "shape": name,
                        "k": kk,
                        "n": n,
                        "dtype": str(dtype).removeprefix("torch."),
                        "m": m,
                        "plain_ms": med["plain"] * 1e3,
                        "contract_over_plain": med["contract"] / med["plain"],
                        "tiled_over_plain": med["tiled"] / med["plain"],
                    }
                    rows.append(row)
                    print(
                        f"{name:>11} {row['dtype']:>9} {m:>4}  {row['plain_ms']:>9.3f}  "
                        f"{row['contract_over_plain']:>14.2f}  {row['tiled_over_plain']:>11.2f}"
                    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_gemm.json"
    body = {"host": describe_host(), "build": build_info("cpu"), "threads": torch.get_num_threads(), "rows": rows}
    out.write_text(json.dumps(body, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
