"""The GPU speed table of the `triton` contract, one prepared run (at most 5 minutes on an H100/H200):
linears vs cuBLAS (gemm_speed.py), attention vs SDPA/FlashAttention (attention_speed.py, where present),
trainer step kernels vs stock spec. Prints one line per row (target, measured, met) and writes the JSON.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 experiments/gpu/speed_table.py \
        --out "$RESULTS/gpu_speed.json"    # RESULTS=experiments/results
    python3 experiments/gpu/speed_table.py --smoke    # CPU, Triton's interpreter: checks the script only

Without CUDA (and without --smoke) it exits 2 with a message, having measured nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (0, 1, 2)]  # gpu/, experiments/, repo root

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "gpu_speed.json"
PARTS = ("gemm", "attention", "trainer")


def _parts(smoke: bool) -> dict[str, Any]:
    from gemm_speed import gemm_rows, trainer_rows

    parts: dict[str, Any] = {"gemm": gemm_rows, "trainer": trainer_rows}
    try:
        from attention_speed import attention_rows
    except ImportError:  # the attention rows' module lands separately
        pass
    else:
        parts["attention"] = attention_rows
    return parts


def _table(rows: dict[str, Any]) -> list[str]:
    lines = [f"{'row':<36} {'target':>7} {'measured':>9} {'met':>5}"]
    for name, r in rows.items():
        if isinstance(r, dict) and "ratio" in r:
            lines.append(f"{name:<36} {r['target']:>6.2f}x {r['ratio']:>8.3f}x {'yes' if r['met'] else 'NO':>5}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes (script check)")
    a = ap.parse_args()
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    if not a.smoke and not torch.cuda.is_available():
        print("speed_table: no CUDA device here; the speed table needs a GPU (--smoke checks the script)")
        return 2
    dev = "cpu" if a.smoke else "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo" if a.smoke else "nccl")
    if not a.smoke:
        torch.cuda.set_device(0)
    import triton

    report: dict[str, Any] = {
        "env": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "gpu": dev == "cuda" and torch.cuda.get_device_name(),
        }
    }
    parts = _parts(a.smoke)
    rows: dict[str, Any] = {}
    for name in a.parts.split(","):
        if name not in parts:
            report[name] = {"skipped": "its module is not in this checkout"}
            continue
        try:
            got = parts[name](dev, a.smoke)
        except Exception as e:  # noqa: BLE001 - one part's failure is a result; the others still run
            traceback.print_exc()
            got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        report[name] = got
        rows |= {k: v for k, v in got.items() if isinstance(v, dict)}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1, default=str))  # after each part: a timeout keeps the rest
    print("\n".join(_table(rows)), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
