"""The default job's rollout in one process: what the embedded server's engine does for one
step of `python -m tonpolicy` (experiment=learn: 16 first_parity prompts x 4 samples, one new token from
the 16 likeliest, rollout.max_running_requests=8, bf16 qwen3_tiny), the plain kernels against the
contract's, without HTTP, so the kernels' share of bench_step.py's rollout time shows alone. Each round
runs both engines back to back in alternating order (A/B, B/A), `--repeats` rollouts each (median);
the ratio is the median over rounds of each round's own ratio. Weights do not change between rollouts
(the job reloads them each step: the contract then re-quantizes its cached weights once).

    .venv/bin/python experiments/bench/bench_rollout.py [--rounds 4] [--repeats 12] [--threads 2] [--profile]

To compare with an earlier tree: `git archive <commit> tonpolicy | tar -x -C /tmp/before`, then run this
with PYTHONPATH=/tmp/before (it prints which tonpolicy it imported). `--profile` also times each kernel
op of one set of rollouts (as bench_engine.py's breakdown).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, median_of, round_ratios  # noqa: E402
from op_timer import timed_ops  # noqa: E402

import tonpolicy  # noqa: E402
from tonpolicy.config.model import ModelConfig  # noqa: E402
from tonpolicy.kernels import get_kernels  # noqa: E402
from tonpolicy.model import Qwen3, init_state_dict  # noqa: E402
from tonpolicy.rl.task import make_prompts  # noqa: E402
from tonpolicy.rollout.engine import Engine, GenRequest  # noqa: E402

# the contract's kernel fields (v1 and v2 share them); experiment=learn's batch; rollout=embedded's batch limit
KERNEL_FIELDS = dict(attention_tile=32, canonical_shards=4, row_tile=4, prefill_row_tile=512)
PROMPTS, SAMPLES, MAX_PROMPT_LEN, TOP_K, MAX_RUNNING = 16, 4, 8, 16, 8
OPS = (
    "linear",
    "linear_k_sharded",
    "lm_head",
    "attention_batched",
    "attention_pooled",
    "rms_norm",
    "swiglu",
    "apply_rope_qk",
)


def requests(step: int) -> list[GenRequest]:
    prompts = make_prompts("first_parity", step, PROMPTS, seed=0, max_prompt_len=MAX_PROMPT_LEN, max_digits=1)
    return [
        GenRequest(p, 1, temperature=1.0, top_k=TOP_K, seed=step * 1000 + i * SAMPLES + s)
        for i, p in enumerate(prompts)
        for s in range(SAMPLES)
    ]


def rollout_s(engine: Engine, step: int) -> float:
    engine.forget_prefixes()  # as after a weight update: no prefix of an earlier step is reused
    reqs = requests(step)
    t0 = time.perf_counter()
    engine.generate(reqs)
    return time.perf_counter() - t0


def profile(engine: Engine, repeats: int) -> dict[str, float]:
    """ms per rollout inside each kernel op (the rest: the model's glue, sampling, the engine)."""
    with timed_ops(engine.model.kernels, OPS) as spent:
        total = sum(rollout_s(engine, 500 + i) for i in range(repeats))
    out = {n: spent[n] / repeats * 1e3 for n in OPS}
    out["other"] = total / repeats * 1e3 - sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the server's default on 2 cores)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kernels", default="ordered", help="the contract's kernel set: ordered (v2) or invariant (v1)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"tonpolicy from {os.path.dirname(tonpolicy.__file__)}; load average {os.getloadavg()[0]:.1f}")
    cfg, dtype = ModelConfig(), torch.bfloat16
    sd = init_state_dict(cfg, dtype, seed=0)
    kernels = {"plain": get_kernels("plain"), "contract": get_kernels(a.kernels, **KERNEL_FIELDS)}
    engines = {
        k: Engine(Qwen3(cfg, kern, dtype, state_dict=sd), max_running_requests=MAX_RUNNING)
        for k, kern in kernels.items()
    }
    for e in engines.values():
        for i in range(3):
            rollout_s(e, i)  # warm-up: plans, caches, the compiled products' build

    def measure(k: str, r: int) -> float:
        return statistics.median(rollout_s(engines[k], 10 + r * a.repeats + i) for i in range(a.repeats)) * 1e3

    rounds = alternate(list(engines), a.rounds, measure)
    ratios = round_ratios(rounds, "contract", "plain")
    print(
        f"rollout ms: plain {median_of(rounds, 'plain'):.1f}, contract {median_of(rounds, 'contract'):.1f} | "
        f"contract/plain {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if a.profile:
        rows = {k: profile(e, a.repeats) for k, e in engines.items()}
        for n in rows["plain"]:
            print(f"  {n:18s} plain {rows['plain'][n]:6.2f} ms  contract {rows['contract'][n]:6.2f} ms")


if __name__ == "__main__":
    main()
