"""Benchmark: the end-to-end RL step of whole jobs (`python -m tonpolicy`: rollout through the server,
gate, PPO update, weight export and the server's reload), the exact contract against the off-policy
control, side by side in one run:

- `contract`: the job as shipped (exact-zero contract; no separate logprob recompute: the gate compares
  the rollout's logprobs with the first training forward, PPO's old logprobs are the rollout's);
- `contract_recompute`: the same with `trainer.recompute_logprobs=true` (what the step cost before);
- `off_policy`: `contract=off_policy`, plain kernels on both engines with the recompute an off-policy
  user needs.

Two jobs: the default job (qwen3_tiny, its `experiment=learn` batch; all three variants, 6 steps) and a
bf16 hidden-1024 model (`shapes.CPU_1024`, 8 layers, 8 samples; contract and off_policy, 4 steps:
its contract step is slow on a small CPU). A step's time is the wall time between two
consecutive step records (`time` in metrics.jsonl), so it includes the server reloading the weights;
the first two steps (optimizer built, caches warmed) are left out. The variants run one after another in
alternating order, round after round, so drift of a shared machine hits all alike; each ratio is the
median over rounds of that round's own ratio of medians.

    .venv/bin/python experiments/bench/bench_step.py [--rounds 2] [--jobs default,h1024]

Targets: contract step / off_policy step <= 1.0 for each job. results/bench_step.json gets
the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, median_of, median_ratio  # noqa: E402
from perf_targets import RESULTS, Check, job_steps, report, with_launch_environment  # noqa: E402
from shapes import CPU_1024  # noqa: E402

STEP_RATIO = 1.0  # end-to-end step, exact contract (no recompute) / off_policy (with the recompute)

VARIANTS = {
    "contract": [],
    "contract_recompute": ["trainer.recompute_logprobs=true"],
    "off_policy": ["contract=off_policy"],
}


def _model_overrides() -> list[str]:
    m = CPU_1024
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "intermediate_size")
    return [f"model.{k}={getattr(m, k)}" for k in (*keys, "vocab_size")] + ["model.name=cpu_1024"]


@dataclass(frozen=True)
class Job:
    overrides: list[str]
    variants: tuple[str, ...]
    steps: int  # the first two are left out


JOBS = {
    # the default job as shipped (experiment=learn: 16 prompts x 4 samples, one new token), fewer steps
    "default": Job([], tuple(VARIANTS), 6),
    # hidden 1024 x 8 layers in bf16: GEMMs, not Python, dominate; 8 samples of up to 12 + 4 tokens
    "h1024": Job(
        [
            *_model_overrides(),
            "contract.dtype=bfloat16",
            "experiment.prompts_per_step=2",
            "experiment.samples_per_prompt=4",
            "experiment.max_prompt_len=12",
            "experiment.max_new_tokens=4",
            "task.graded_tokens=1",
        ],
        ("contract", "off_policy"),
        4,
    ),
}


def run_job(job: str, variant: str, root: Path) -> dict[str, Any]:
    run_dir = root / f"{job}_{variant}_{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "tonpolicy", "mode=run", "logger=none", f"experiment.steps={JOBS[job].steps}"]
    argv += [*JOBS[job].overrides, *VARIANTS[variant], f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{job}/{variant} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    recs, step_s = job_steps(run_dir)
    return {
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        # where the time goes: the rollout, and the rest of the record's step (recompute, gate, update, export)
        "rollout_s": statistics.median(r["rollout_s"] for r in recs[2:]),
        "train_s": statistics.median(r["step_s"] - r["rollout_s"] for r in recs[2:]),
        "recompute": recs[-1]["recompute"],
        "mismatched_tokens": [r["mismatched_tokens"] for r in recs],
        "job_wall_s": wall,
    }


def _step_s(run: dict[str, Any]) -> float:
    return run["median_step_s"]


def _train_s(run: dict[str, Any]) -> float:
    return run["train_s"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", default="default,h1024")
    ap.add_argument(
        "--merge", action="store_true", help="keep results/bench_step.json's other jobs (re-measure one job only)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="three rounds of the default job (perf_report.py keeps the h1024 row)"
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.jobs, a.merge = 3, "default", True  # one round alone swings widely, even on a quiet host
    root = Path(tempfile.mkdtemp(prefix="bench_step_"))
    results: dict[str, Any] = {}
    checks = []
    for job in a.jobs.split(","):
        variants = list(JOBS[job].variants)

        def progress(k: int, r: dict[str, Any], job: str = job, variants: list[str] = variants) -> None:
            parts = [
                f"{v} {_step_s(r[v]):.2f} s/step (rollout {r[v]['rollout_s']:.2f}, trainer {_train_s(r[v]):.2f})"
                for v in variants
            ]
            if {"contract", "off_policy"} <= set(variants):
                parts.append(f"contract/off_policy {_step_s(r['contract']) / _step_s(r['off_policy']):.2f}x")
            print(f"{job} round {k}: " + "  ".join(parts), flush=True)

        rounds = alternate(variants, a.rounds, lambda v, _r, job=job: run_job(job, v, root), progress)
        med = {v: median_of(rounds, v, _step_s) for v in variants}
        ratios: dict[str, float] = {}
        if "off_policy" in variants:
            for v in variants:
                if v != "off_policy":
                    ratios[f"{v}_over_off_policy"] = median_ratio(rounds, v, "off_policy", _step_s)
            for v in variants:  # the trainer's part of the step alone (step_s less rollout_s): what the recompute costs
                if v != "off_policy":
                    ratios[f"{v}_over_off_policy_trainer_part"] = median_ratio(rounds, v, "off_policy", _train_s)
        if "contract" in variants and "contract_recompute" in variants:
            ratios["contract_over_contract_recompute"] = median_ratio(rounds, "contract", "contract_recompute", _step_s)
        results[job] = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "overrides": JOBS[job].overrides,
            "steps": JOBS[job].steps,
            "median_step_s": med,
            "ratios": ratios,
            "rounds": rounds,
        }
        print(
            f"{job}: "
            + "  ".join(f"{v} {s:.2f} s" for v, s in med.items())
            + "  |  "
            + "  ".join(f"{k} {x:.2f}x" for k, x in ratios.items()),
            flush=True,
        )
        if "contract_over_off_policy" in ratios:
            checks.append(
                Check(f"end-to-end step {job}, contract/off_policy", ratios["contract_over_off_policy"], STEP_RATIO)
            )
    if a.merge and (RESULTS / "bench_step.json").exists():  # each job keeps its own date and workload
        kept = json.loads((RESULTS / "bench_step.json").read_text())
        for job, body in kept["data"]["jobs"].items():
            results.setdefault(job, {"date": kept["date"], **body})
        own = {c.name for c in checks}
        fields = ("name", "measured", "target", "at_most")
        checks += [
            Check(
                **{k: c[k] for k in fields}, machine=c.get("machine", kept["machine"]), date=c.get("date", kept["date"])
            )
            for c in kept["checks"]
            if c["name"] not in own
        ]
    report("bench_step", checks, {"workload": vars(a), "jobs": results})
    return results


if __name__ == "__main__":
    with_launch_environment()
    main()
