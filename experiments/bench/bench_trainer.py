"""Benchmark: one trainer training step (forward, backward, optimizer) with the kernel layer spec vs
megatron's stock local spec on the same batch, in one run, at TP1 and TP2; plus the share of the
step spent in the logprob recipe (TP vocab gather -> fp32 log-softmax -> gather; forward part) and in
the parity comparison.

    .venv/bin/python experiments/bench/bench_trainer.py [--samples 8] [--prompt-len 96] [--response-len 32]
        [--steps 20] [--dtypes float32,bfloat16] [--tp 1 2] [--model qwen3_moe_tiny --ep 2]

`--model` takes any profile (e.g. `qwen3_moe_tiny`: the MoE contract against megatron's stock MoE);
`--ep N` runs each TP at dp=N, ep=N (expert parallelism carved out of data parallelism, as Megatron does).

Every target (contract step / stock step <= 1.1 at each TP and dtype; 1.2 for an MoE profile) is printed
as measured / target; results/bench_trainer.json (bench_moe_trainer.json for qwen3_moe_tiny) gets the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, median_of, median_ratio  # noqa: E402
from perf_targets import TRAINER_RATIO, Check, report, with_launch_environment  # noqa: E402

from tonpolicy.align import harness  # noqa: E402
from tonpolicy.families import family  # noqa: E402
from tonpolicy.trainer.process_groups import Layout, spawn  # noqa: E402


def _step_s(measured: tuple[float, float]) -> float:
    return measured[0]


def _share(measured: tuple[float, float]) -> float:
    return measured[1]


def _bench(layout: Layout, dtype: str, checkpoint: str, batch: dict, steps: int) -> dict[str, Any]:
    from tonpolicy.rl.train_samples import TrainSamples
    from tonpolicy.trainer import schedule
    from tonpolicy.trainer.process_groups import reset_model_parallel
    from tonpolicy.trainer.worker import TrainerWorker

    recipe = {"s": 0.0}
    inner = schedule.token_logprobs

    def timed(*a: Any, **k: Any) -> torch.Tensor:
        t = time.perf_counter()
        out = inner(*a, **k)
        recipe["s"] += time.perf_counter() - t
        return out

    schedule.token_logprobs = timed
    out: dict[str, Any] = {"layout": str(layout), "dtype": dtype}
    p, r = batch["prompts"], batch["responses"]
    # Both specs live side by side (same process groups) and their steps alternate.
    workers, samples = {}, {}
    for spec in ("kernels", "stock"):
        cfg = harness.make_config(layout, dtype, "exact", 1.0, checkpoint)
        workers[spec] = TrainerWorker(cfg, checkpoint, spec=spec)
        old = workers[spec].logprobs(p, r)
        samples[spec] = TrainSamples(p, r, old, old, batch["advantages"])
    cmp_s: list[float] = []

    def measure(spec: str, _round: int) -> tuple[float, float]:
        """(seconds of one step, the share of it in the logprob recipe)."""
        recipe["s"] = 0.0
        t0 = time.perf_counter()
        workers[spec].ppo_step(samples[spec])
        dt = time.perf_counter() - t0
        if spec == "kernels":
            t1 = time.perf_counter()
            old = samples[spec].rollout_logprobs
            harness.compare(old, [x.clone() for x in old])
            cmp_s.append(time.perf_counter() - t1)
        return dt, recipe["s"] / dt

    rounds = alternate(list(workers), steps + 1, measure)[1:]  # the first step builds DDP/optimizer: warm-up
    for spec, w in workers.items():
        step_s = median_of(rounds, spec, _step_s)
        out[spec] = {
            "step_s": step_s,
            "recipe_share": median_of(rounds, spec, _share),
            "parity_compare_share": statistics.median(cmp_s[1:]) / step_s,
        }
        w.close()
    reset_model_parallel()
    out["contract_over_stock"] = median_ratio(rounds, "kernels", "stock", _step_s)
    return out


MOE_TRAINER_RATIO = 1.2  # the MoE trainer step, contract spec / stock MoE spec
# The performance report's rows: its profiles' results files.
REPORT_NAMES = {"qwen3_tiny": "bench_trainer", "qwen3_moe_tiny": "bench_moe_trainer"}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)  # fewer left a 2-core VM's spread too wide
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default="qwen3_tiny")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="6 steps (perf_report.py's re-measure)")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps = min(a.steps, 6)
    from tonpolicy.config.compose import compose_config
    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    cfg = compose_config([f"model={a.model}"]).model
    moe = family(cfg.family).routed_experts
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
        for tp in a.tp:
            layout = Layout(tp=tp, dp=a.ep, ep=a.ep)
            r = spawn(_bench, tp * a.ep, layout, dtype, ck, batch, a.steps)
            results.append(r)
            c, s = r["kernels"], r["stock"]
            print(
                f"{r['layout']:>8} {dtype}: contract {c['step_s'] * 1e3:8.1f} ms  stock {s['step_s'] * 1e3:8.1f} ms"
                f"  ratio {r['contract_over_stock']:.2f}x  | logprob recipe {c['recipe_share']:.2%} of the contract "
                f"step (stock {s['recipe_share']:.2%}), parity compare {c['parity_compare_share']:.3%}"
            )
            short = "bf16" if dtype == "bfloat16" else "fp32"
            what, target = ("MoE trainer", MOE_TRAINER_RATIO) if moe else ("trainer", TRAINER_RATIO)
            checks.append(Check(f"{what} step {layout} {short}, contract/stock spec", r["contract_over_stock"], target))
    name = (REPORT_NAMES.get(a.model) if a.ep == 1 else None) or f"bench_trainer_{a.model}_ep{a.ep}"
    report(name, checks, {"workload": vars(a), "runs": results})
    return results


if __name__ == "__main__":
    with_launch_environment()
    main()
