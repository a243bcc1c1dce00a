"""What the AMX settings cost (`tonpolicy/cpu_numerics.py`): the same work under the GEMM libraries'
defaults and under the settings tonpolicy sets on an AMX CPU (`MKL_CBWR=AUTO,STRICT`,
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`).

Both libraries read those variables once, at their first call, so each side runs in its own fresh
process; the two alternate for `--rounds` rounds and each cell keeps its median, so machine drift hits
both alike. Measured per side: plain GEMMs of an MLP-sized weight at 1, 4, 64 and 512 rows (fp32 and
bf16), and the engine's prefill and decode tokens/s of the hidden-1024 model under the contract
(`invariant`) and the plain (`default`) kernels. Ratios are time under the settings / time under the
defaults (>1: the settings cost). Also measured, under each side: whether a bf16 GEMM's row bits depend
on the row count (rows 4..128 vs the same rows among 512) and on the thread count (1 vs 2) — why the
contract cannot simply keep AMX on and pad every GEMM to one fixed row count. On a CPU without AMX
tonpolicy sets nothing; the script still runs both sides (the variables act on any CPU), but its numbers
answer the question only on an AMX CPU.

    .venv/bin/python experiments/bench_cpu_numerics.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tonpolicy.cpu_numerics import AMX_SETTINGS, has_amx

# Each side's values for both variables (set explicitly: importing tonpolicy keeps a value already set).
SIDES = {"defaults": {"MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "ALL"}, "amx_settings": dict(AMX_SETTINGS)}
GEMM_ROWS = (1, 4, 64, 512)
ENGINE_WORK = dict(requests=8, prompt=128, gen=8)


def _gemm_us(rows: int, dtype: object, weight: object, min_s: float = 0.3) -> float:
    import torch

    x = torch.randn(rows, weight.shape[1]).to(dtype)
    for _ in range(5):
        torch.mm(x, weight.t())
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        torch.mm(x, weight.t())
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e6


PROBE_SHAPES = ((3072, 1024), (1024, 3072), (2048, 1024), (4096, 4096))  # [N, K] of a bf16 weight


def bf16_bits_probe() -> dict:
    """Per weight shape: the row counts (multiples of 4 up to 128) whose rows differ from the same rows in
    a 512-row GEMM, and whether a 64-row GEMM's bits change with 2 threads instead of 1."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for n, k in PROBE_SHAPES:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(512, k, generator=g).bfloat16()
        ref = torch.mm(x, w.t())
        rows = [m for m in range(4, 129, 4) if not torch.equal(torch.mm(x[:m], w.t()), ref[:m])]
        before = torch.get_num_threads()
        one = torch.mm(x[:64], w.t())
        torch.set_num_threads(2)
        two = torch.mm(x[:64], w.t())
        torch.set_num_threads(before)
        out[f"{n}x{k}"] = {"row_counts_that_differ": rows, "threads_change_bits": not torch.equal(one, two)}
    return out


def measure(threads: int) -> dict:
    """One side's numbers, in this process (run under that side's environment)."""
    import torch
    from bench_engine import MIN_MEASURE_S, _requests, _time
    from bench_models import CPU_1024

    from tonpolicy.kernels import get_kernels
    from tonpolicy.model import Qwen3, init_state_dict

    torch.set_num_threads(threads)
    cfg, out = CPU_1024, {"gemm_us": {}, "engine": {}, "bf16_bits": bf16_bits_probe()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        w = torch.randn(cfg.intermediate_size, cfg.hidden_size).to(dtype)
        for rows in GEMM_ROWS:
            out["gemm_us"][f"{name} {rows} rows"] = _gemm_us(rows, dtype, w)
        sd = init_state_dict(cfg, dtype, seed=0)
        pre = _requests(cfg, ENGINE_WORK["requests"], ENGINE_WORK["prompt"], 1)
        full = _requests(cfg, ENGINE_WORK["requests"], ENGINE_WORK["prompt"], 1 + ENGINE_WORK["gen"])
        for kind in ("invariant", "default"):
            model = Qwen3(cfg, get_kernels(kind), dtype, state_dict=sd)
            _time(model, pre[:1])  # warm-up: the kernels' caches
            tp = _time(model, pre, min_s=MIN_MEASURE_S)
            td = max(_time(model, full, min_s=MIN_MEASURE_S) - tp, 1e-9)
            out["engine"][f"{name} {kind} prefill s"] = tp
            out["engine"][f"{name} {kind} decode s"] = td
    return out


def _side(name: str, threads: int) -> dict:
    env = {**os.environ, **SIDES[name]}
    cmd = [sys.executable, __file__, "--child", "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=Path(__file__).parent)
    if proc.returncode != 0:
        raise SystemExit(f"{name} side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads)))
        return
    from perf_targets import RESULTS

    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for side in SIDES:
            runs[side].append(_side(side, args.threads))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {
        side: {
            group: {k: statistics.median(run[group][k] for run in rs) for k in rs[0][group]}
            for group in ("gemm_us", "engine")
        }
        for side, rs in runs.items()
    }
    ratios = {
        group: {k: med["amx_settings"][group][k] / med["defaults"][group][k] for k in med["defaults"][group]}
        for group in ("gemm_us", "engine")
    }
    print(f"\nCPU has AMX: {has_amx()}; threads={args.threads}, rounds={args.rounds}")
    print("time under the AMX settings / under the libraries' defaults (>1: the settings cost)")
    for group, title in (("gemm_us", "GEMM [rows, 1024] x [1024, 3072]"), ("engine", "engine, hidden-1024")):
        print(f"  {title}:")
        for k, v in ratios[group].items():
            d, s = med["defaults"][group][k], med["amx_settings"][group][k]
            unit = "us" if group == "gemm_us" else "s"
            print(f"    {k:28s} {v:5.2f}x  ({d:.4g} -> {s:.4g} {unit})")
    bits = {side: rs[0]["bf16_bits"] for side, rs in runs.items()}
    print("  bf16 GEMM bits [N x K]: row counts (4..128) whose rows differ from a 512-row GEMM; 1 vs 2 threads")
    for side, per in bits.items():
        for shape, b in per.items():
            print(
                f"    {side:13s} {shape:10s} rows {b['row_counts_that_differ'] or 'none'}; "
                f"threads change bits: {b['threads_change_bits']}"
            )
    out = RESULTS / "bench_cpu_numerics.json"
    data = {
        "has_amx": has_amx(),
        "sides": SIDES,
        "work": ENGINE_WORK,
        "median": med,
        "ratios": ratios,
        "bf16_bits": bits,
    }
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
