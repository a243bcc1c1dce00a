"""Benchmark: asynchronous steps and a fleet, side by side in one run.

Whole default jobs (`python -m tonpolicy`: qwen3_tiny, experiment=learn, 16 prompts x 4 samples) in
four variants, run one after another in alternating order:

- `r1_s0`: one rollout server, synchronous steps (the job as shipped);
- `r1_s1`: one server, `experiment.max_staleness=1` (the next batch generated while the trainer trains);
- `r2_s0`, `r2_s1`: the same with `rollout.replicas=2` behind sglang-router.

Every rollout process (server replicas, router) is pinned to core 0 and every trainer process to core 1
(`os.sched_setaffinity` on each process and thread of the job's process groups, re-applied while the
job runs, so torchrun's workers are caught too), and each job runs with OMP_NUM_THREADS=1: the server
and the trainer each own one core, so overlap can show. On a 2-core host the two replicas share core 0.

`--workload long` runs a rollout-heavy job instead (digit_copy, 16 samples of up to 24 new tokens
sampled from the whole vocabulary, `--steps` steps for every variant), where generation is a large share
of the step and overlap has something to hide; the default job's rollout is one token per sample.

A step's time is the wall time between consecutive step records (`time` in metrics.jsonl, so it holds
everything: rollout or the wait for it, gate, update, export, the servers' reload); steps 0-1 are left
out. The `s0`/`s1` pair of one server runs the default job's 24 steps, so its reward curve says whether
staleness 1 still learns; the fleet pair runs `--fleet-steps`.

    .venv/bin/python experiments/bench/bench_async.py [--rounds 1] [--fleet-steps 8]
    .venv/bin/python experiments/bench/bench_async.py --workload long --steps 6 --fleet-steps 6

results/bench_async.json (results/bench_async_long.json) gets the numbers; docs/PERFORMANCE.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, median_of, median_ratio  # noqa: E402
from perf_targets import Check, job_steps, report, with_launch_environment  # noqa: E402

VARIANTS = {
    "r1_s0": [],
    "r1_s1": ["experiment.max_staleness=1"],
    "r2_s0": ["rollout.replicas=2"],
    "r2_s1": ["rollout.replicas=2", "experiment.max_staleness=1"],
}
WORKLOADS = {
    "default": [],
    "long": [
        "task=digit_copy",
        "task.graded_tokens=6",
        "experiment.top_k=-1",
        "experiment.prompts_per_step=4",
        "experiment.samples_per_prompt=4",
        "experiment.max_prompt_len=12",
        "experiment.max_new_tokens=24",
    ],
}
ROLLOUT_CORE, TRAINER_CORE = 0, 1


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return out


def _pin(pid: int, core: int) -> None:
    for p in _tree(pid):
        try:
            for tid in os.listdir(f"/proc/{p}/task"):  # every thread: affinity is per thread
                os.sched_setaffinity(int(tid), {core})
        except OSError:
            continue  # gone meanwhile


def _pinner(run_dir: Path, stop: threading.Event, cores: int) -> None:
    while not stop.wait(0.2):
        try:
            pids = json.loads((run_dir / "pids.json").read_text())
        except (OSError, ValueError):
            continue
        for name, pid in pids.items():
            _pin(pid, TRAINER_CORE if name == "trainer" or cores < 2 else ROLLOUT_CORE)


def run_job(variant: str, steps: int, root: Path, workload: str = "default") -> dict[str, Any]:
    run_dir = root / f"{variant}_{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "tonpolicy", "mode=run", "logger=none", f"experiment.steps={steps}"]
    argv += [*WORKLOADS[workload], *VARIANTS[variant], f"hydra.run.dir={run_dir}"]
    stop = threading.Event()
    pinner = threading.Thread(target=_pinner, args=(run_dir, stop, os.cpu_count() or 1), daemon=True)
    pinner.start()
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=1800, env=env)
    finally:
        stop.set()
        pinner.join()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{variant} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    recs, step_s = job_steps(run_dir)
    return {
        "steps": steps,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "steps_per_s": len(step_s) / sum(step_s),  # steps 2.. over the time they took
        "rollout_s": statistics.median(r["rollout_s"] for r in recs[2:]),  # s1: the wait for the batch
        "reward": [r["reward_mean"] for r in recs],
        "mismatched_tokens": [r["mismatched_tokens"] for r in recs],
        "staleness": [r.get("staleness") for r in recs],
        "job_wall_s": wall,
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _step_s(run: dict[str, Any]) -> float:
    return run["median_step_s"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24, help="the one-server jobs' steps (the default run's 24)")
    ap.add_argument("--fleet-steps", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workload", default="default", choices=list(WORKLOADS))
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_async_"))
    variants = a.variants.split(",")

    def measure(v: str, _round: int) -> dict[str, Any]:
        return run_job(v, a.steps if v.startswith("r1") else a.fleet_steps, root, a.workload)

    def progress(k: int, r: dict[str, Any]) -> None:
        for v, x in r.items():
            print(
                f"round {k} {v}: {x['median_step_s']:.3f} s/step ({x['steps_per_s']:.2f} steps/s, rollout/wait "
                f"{x['rollout_s']:.3f} s), reward {x['reward'][0]:.3f} -> {_mean(x['reward'][-4:]):.3f} (last 4), "
                f"mismatched {sum(x['mismatched_tokens'])}, job {x['job_wall_s']:.0f} s",
                flush=True,
            )

    rounds = alternate(variants, a.rounds, measure, progress)
    med = {v: median_of(rounds, v, _step_s) for v in variants}
    ratios: dict[str, float] = {}
    for rep in ("r1", "r2"):  # throughput s1 / s0: > 1 means the overlap pays
        if f"{rep}_s0" in variants and f"{rep}_s1" in variants:
            ratios[f"{rep}_throughput_s1_over_s0"] = median_ratio(rounds, f"{rep}_s0", f"{rep}_s1", _step_s)
    for s in ("s0", "s1"):  # throughput 2 replicas / 1
        if f"r1_{s}" in variants and f"r2_{s}" in variants:
            ratios[f"{s}_throughput_r2_over_r1"] = median_ratio(rounds, f"r1_{s}", f"r2_{s}", _step_s)
    learning = {
        v: {
            "reward_first_4": statistics.median(_mean(r[v]["reward"][:4]) for r in rounds),
            "reward_last_4": statistics.median(_mean(r[v]["reward"][-4:]) for r in rounds),
        }
        for v in variants
        if v.startswith("r1") and a.workload == "default"  # the default task's curve; `long` is for speed
    }
    print("median s/step: " + "  ".join(f"{v} {s:.3f}" for v, s in med.items()))
    print("throughput ratios: " + "  ".join(f"{k} {x:.2f}x" for k, x in ratios.items()))
    print("reward (first 4 -> last 4 steps): " + "  ".join(f"{v} {x['reward_first_4']:.3f} -> "
          f"{x['reward_last_4']:.3f}" for v, x in learning.items()))  # fmt: skip
    checks = [
        Check(f"steps/s staleness 1 / 0, {k[:2]}", x, 1.0, at_most=False) for k, x in ratios.items() if "s1_over" in k
    ]
    for v, x in learning.items():
        rise = x["reward_last_4"] - x["reward_first_4"]
        checks.append(Check(f"reward rises at staleness {v[-1]} (last 4 - first 4)", rise, 0.0, at_most=False))
    host = {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}
    data = {"workload": vars(a), "host": host, "median_step_s": med, "ratios": ratios, "learning": learning}
    report("bench_async" + ("" if a.workload == "default" else f"_{a.workload}"), checks, data | {"rounds": rounds})
    return {"median_step_s": med, "ratios": ratios, "learning": learning}


if __name__ == "__main__":
    with_launch_environment()
    main()
