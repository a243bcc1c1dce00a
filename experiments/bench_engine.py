"""Engine throughput under the `contract` kernels vs the `default` (plain torch) kernels.

Same model weights, same workload, one process; runs alternate between the two kernel sets and the
median of `--repeats` is kept, so machine noise hits both alike. Prefill tokens/s comes from runs with
max_new_tokens=1 (one prefill step per request); decode tokens/s from the extra time of runs with
max_new_tokens=1+G. Ratios are contract time / default time (>1: contract is slower).

    .venv/bin/python experiments/bench_engine.py [--models tiny,large] [--dtype bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch
from bench_models import CPU_1024

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3, init_state_dict
from tonpolicy.rollout.engine import Engine, GenRequest

MODELS = {
    "tiny": (ModelConfig(), dict(requests=16, prompt=200, gen=32)),
    "large": (CPU_1024, dict(requests=16, prompt=128, gen=16)),
}


def _requests(cfg: ModelConfig, n: int, prompt: int, gen: int) -> list[GenRequest]:
    rng = random.Random(0)
    return [GenRequest([rng.randrange(cfg.vocab_size) for _ in range(prompt)], gen, seed=i) for i in range(n)]


def _time(model: Qwen3, reqs: list[GenRequest]) -> float:
    t0 = time.perf_counter()
    Engine(model, max_running_requests=len(reqs)).generate(reqs)
    return time.perf_counter() - t0


KERNEL_OPS = ("linear", "lm_head", "attention_pooled", "rms_norm", "swiglu", "apply_rope", "rope_cos_sin", "logprobs")


def breakdown(model: Qwen3, reqs: list[GenRequest]) -> str:
    """Where the time goes: wall time inside each kernel op during one generate() call."""
    kern = model.kernels
    spent: collections.Counter[str] = collections.Counter()
    saved = {n: getattr(kern, n) for n in KERNEL_OPS}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t0
            return out

        return run

    for n, fn in saved.items():
        setattr(kern, n, timed(n, fn))
    try:
        total = _time(model, reqs)
    finally:
        for n in saved:
            delattr(kern, n)  # back to the class methods
    spent["other (engine, sampling, glue)"] = total - sum(spent.values())
    return f"{total:.2f}s: " + ", ".join(f"{n} {100 * t / total:.0f}%" for n, t in spent.most_common())


def bench(name: str, dtype: torch.dtype, repeats: int, profile: bool) -> dict[str, float]:
    cfg, w = MODELS[name]
    sd = init_state_dict(cfg, dtype, seed=0)
    models = {k: Qwen3(cfg, get_kernels(k), dtype, state_dict=sd) for k in ("contract", "default")}
    pre = _requests(cfg, w["requests"], w["prompt"], 1)
    full = _requests(cfg, w["requests"], w["prompt"], 1 + w["gen"])
    times: dict[str, dict[str, list[float]]] = {k: {"pre": [], "full": []} for k in models}
    for m in models.values():  # warm-up
        _time(m, pre[:1])
    for _ in range(repeats):
        for k, m in models.items():
            times[k]["pre"].append(_time(m, pre))
            times[k]["full"].append(_time(m, full))
    out: dict[str, float] = {}
    for k in models:
        tp = statistics.median(times[k]["pre"])
        td = max(statistics.median(times[k]["full"]) - tp, 1e-9)
        out[f"{k}_prefill_tok_s"] = w["requests"] * w["prompt"] / tp
        out[f"{k}_decode_tok_s"] = w["requests"] * w["gen"] / td
    out["prefill_ratio"] = out["default_prefill_tok_s"] / out["contract_prefill_tok_s"]
    out["decode_ratio"] = out["default_decode_tok_s"] / out["contract_decode_tok_s"]
    if profile:
        for k, m in models.items():
            print(f"  {name} {k:8s} prefill run {breakdown(m, pre)}")
            print(f"  {name} {k:8s} full run    {breakdown(m, full)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print where the time goes, per kernel op")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"dtype={args.dtype} threads={args.threads} repeats={args.repeats}")
    for name in args.models.split(","):
        cfg, w = MODELS[name]
        r = bench(name, dtype, args.repeats, args.profile)
        print(
            f"{name:6s} (hidden {cfg.hidden_size}, {cfg.num_layers} layers, {w['requests']} req x "
            f"{w['prompt']} prompt + {w['gen']} gen): "
            f"prefill tok/s contract {r['contract_prefill_tok_s']:.0f} default {r['default_prefill_tok_s']:.0f} "
            f"ratio {r['prefill_ratio']:.2f}x | decode tok/s contract {r['contract_decode_tok_s']:.1f} "
            f"default {r['default_decode_tok_s']:.1f} ratio {r['decode_ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
