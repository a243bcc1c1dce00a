"""Benchmark: the MoE trainer step with the contract's layer spec vs megatron's stock MoE spec, side by
side: bench_trainer's measurement on the MoE profile at TP1, the performance report's "MoE trainer" row.

    .venv/bin/python experiments/bench/bench_moe_trainer.py [--steps 10] [--dtypes float32,bfloat16]
        [--quick]  (any other bench_trainer flag too)

Writes results/bench_moe_trainer.json (one check per dtype: contract step / stock step <= 1.2).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # experiments/: the helpers the scripts share
sys.path.insert(0, str(HERE))

import bench_trainer  # noqa: E402
from perf_targets import with_launch_environment  # noqa: E402

PROFILE = ["--model", "qwen3_moe_tiny", "--tp", "1", "--steps", "10"]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return bench_trainer.main([*PROFILE, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    with_launch_environment()
    main()
