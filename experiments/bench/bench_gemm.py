"""What a contract GEMM costs against torch's own products, measured side by side in one run.

`--set invariant` (contract v1, tonpolicy.kernels.invariant.exact_gemm): the contract's linear (exact
fixed-point, fp64) against plain `F.linear` and against the strategy it replaced (library GEMMs in fixed
row tiles: 512-row tiles and a tail padded to 4 rows, whose bits rest on how MKL and oneDNN happen to
block on the measured CPU), at the tiny and the hidden-1024 model's shapes; results/bench_gemm.json.

`--set ordered` (contract v2, tonpolicy.kernels.invariant.ordered_gemm): `ordered_gemm.linear` against
`F.linear` (oneDNN / MKL), then the attention's batched products, `ordered_gemm.bmm` against `torch.bmm`
(`--no-bmm` skips them); results/bench_gemm_ordered.json.

Decode and prefill row counts, bf16 and fp32; every cell alternates its variants over `--rounds`
(experiments/alternate.py). A ratio below 1 means the contract's product is faster. Measure on a quiet
host: on 2 vCPUs a second busy process quantises 2-thread calls into scheduler slices.

    .venv/bin/python experiments/bench/bench_gemm.py [--set invariant|ordered] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import compare_calls, median_of, median_ratio  # noqa: E402
from perf_targets import RESULTS  # noqa: E402

from tonpolicy.contract.identity import build_info  # noqa: E402
from tonpolicy.cpu_numerics import describe_host  # noqa: E402
from tonpolicy.kernels import get_kernels  # noqa: E402
from tonpolicy.kernels.invariant import ordered_gemm  # noqa: E402

# name -> (K, N) of the weight
SHAPES = {
    "invariant": {
        "tiny qkv": (128, 256),
        "tiny down": (384, 128),
        "large up": (1024, 3072),
        "large down": (3072, 1024),
    },
    "ordered": {"1024x3072": (1024, 3072), "3072x1024": (3072, 1024), "1024x1024": (1024, 1024), "64x192": (64, 192)},
}
ROWS = (1, 4, 64, 512)
BMM_SHAPES = [(64, m, k, n) for m in (1, 16, 64) for k, n in ((128, 32), (32, 128))]  # B, M, K, N


def tiled_library(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The replaced strategy: library GEMMs of 512-row tiles, the tail zero-padded to a multiple of 4."""
    m, _ = x.shape
    big = m // 512 * 512
    parts = [torch.mm(x[a : a + 512], w.t()) for a in range(0, big, 512)]
    if m > big:
        tail = x[big:]
        pad = -tail.shape[0] % 4
        parts.append(torch.mm(F.pad(tail, (0, 0, 0, pad)), w.t())[: tail.shape[0]])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def linear_sides(kernel_set: str, x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The variants of one cell, torch's product first (the ratios' denominator)."""
    if kernel_set == "ordered":
        return {"torch": lambda: F.linear(x, w), "contract": lambda: ordered_gemm.linear(x, w)}
    k = get_kernels("invariant")
    return {"torch": lambda: F.linear(x, w), "contract": lambda: k.linear(x, w), "tiled": lambda: tiled_library(x, w)}


def cell(fns: dict[str, Callable[[], object]], rounds: int, min_s: float) -> dict[str, float]:
    """torch's ms per call, and each other variant's time over torch's (median of the rounds' ratios)."""
    times = compare_calls(fns, rounds, min_s)
    out = {"torch_ms": median_of(times, "torch") * 1e3}
    out |= {f"{v}_over_torch": median_ratio(times, v, "torch") for v in fns if v != "torch"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="invariant", choices=list(SHAPES), help="whose GEMM: contract v1 or v2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-ms", type=float, default=20.0, help="time per variant per round (at least one call)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--no-bmm", action="store_true", help="--set ordered: skip the batched products")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    min_s, rows = a.min_ms / 1e3, [int(m) for m in a.rows.split(",")]
    path = f", path {ordered_gemm.chosen_path()}" if a.set == "ordered" else ""
    print(f"host: {describe_host()}; torch {torch.__version__}, {a.threads} threads{path}, {a.rounds} rounds, "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'shape':>11} {'dtype':>9} {'M':>4}  {'torch ms':>9}  ratios to torch")
    cells = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, (k, n) in SHAPES[a.set].items():
            for dt in a.dtypes.split(","):
                w = (torch.randn(n, k, generator=g) * k**-0.5).to(getattr(torch, dt))
                for m in rows:
                    x = torch.randn(m, k, generator=g).to(w.dtype)
                    row = {"shape": name, "k": k, "n": n, "dtype": dt, "m": m}
                    row |= cell(linear_sides(a.set, x, w), a.rounds, min_s)
                    cells.append(row)
                    ratios = "  ".join(f"{key} {v:.2f}" for key, v in row.items() if key.endswith("_over_torch"))
                    print(f"{name:>11} {dt:>9} {m:>4}  {row['torch_ms']:>9.3f}  {ratios}", flush=True)
        if a.set == "ordered" and not a.no_bmm:
            for dt in a.dtypes.split(","):
                for bsz, m, k, n in BMM_SHAPES:
                    x = torch.randn(bsz, m, k, generator=g).to(getattr(torch, dt))
                    y = torch.randn(bsz, k, n, generator=g).to(x.dtype)
                    fns = {
                        "torch": lambda x=x, y=y: torch.bmm(x, y),
                        "contract": lambda x=x, y=y: ordered_gemm.bmm(x, y),
                    }
                    row = {"shape": f"bmm {bsz},{m},{k},{n}", "dtype": dt, "m": m} | cell(fns, a.rounds, min_s)
                    cells.append(row)
                    print(f"{row['shape']:>15} {dt:>9}  {row['torch_ms']:>9.3f}  contract_over_torch "
                          f"{row['contract_over_torch']:.2f}", flush=True)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("bench_gemm.json" if a.set == "invariant" else "bench_gemm_ordered.json")
    body = {
        "host": describe_host(),
        "build": build_info("cpu"),
        "threads": a.threads,
        "rounds": a.rounds,
        "rows": cells,
    }
    out.write_text(json.dumps(body, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
