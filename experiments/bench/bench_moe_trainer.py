"""Benchmark: the MoE trainer step (forward, backward, optimizer) with the contract's layer spec vs
megatron's stock MoE spec on the same batch, in one run, side by side (bench_trainer's measurement,
on the MoE profile): the row "MoE engine and trainer <= 1.2x" of the performance report.

    .venv/bin/python experiments/bench/bench_moe_trainer.py [--steps 10] [--dtypes float32,bfloat16]
        [--quick]

Writes results/bench_moe_trainer.json (one check per dtype: contract step / stock step <= 1.2).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # experiments/: the helpers the scripts share
sys.path.insert(0, str(HERE))

from bench_trainer import _bench  # noqa: E402
from perf_targets import Check, report, with_launch_environment  # noqa: E402

from tonpolicy.trainer.process_groups import Layout, spawn  # noqa: E402

MOE_TRAINER_RATIO = 1.2  # MoE trainer step, contract spec / stock MoE spec
MODEL = "qwen3_moe_tiny"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="5 steps (perf_report.py's re-measure)")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 5)
    from tonpolicy.config.compose import compose_config
    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    cfg = compose_config([f"model={MODEL}"]).model
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompts": [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.samples)],
        "responses": [
            torch.randint(0, cfg.vocab_size, (a.response_len,), generator=g).tolist() for _ in range(a.samples)
        ],
        "advantages": torch.randn(a.samples, generator=g).tolist(),
    }
    results, checks = [], []
    for dtype in a.dtypes.split(","):
        ck = str(Path(tempfile.mkdtemp()) / "ckpt")
        save_hf(init_state_dict(cfg, getattr(torch, dtype), 3), cfg, ck)
        layout = Layout(tp=1)
        r = spawn(_bench, 1, layout, dtype, ck, batch, a.steps)
        results.append(r)
        c, s = r["kernels"], r["stock"]
        print(
            f"MoE {r['layout']:>8} {dtype}: contract {c['step_s'] * 1e3:8.1f} ms  stock {s['step_s'] * 1e3:8.1f} ms"
            f"  ratio {r['contract_over_stock']:.2f}x"
        )
        short = "bf16" if dtype == "bfloat16" else "fp32"
        checks.append(
            Check(
                f"MoE trainer step {layout} {short}, contract/stock spec", r["contract_over_stock"], MOE_TRAINER_RATIO
            )
        )
    report("bench_moe_trainer", checks, {"workload": vars(a) | {"model": MODEL}, "runs": results})
    return results


if __name__ == "__main__":
    with_launch_environment()
    main()
