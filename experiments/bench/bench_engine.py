"""Engine throughput and memory under the contract's kernels (`ordered`, v2) vs the `plain` (plain torch) kernels.

Same model weights, same workload, one process; the kernel sets alternate over `--repeats` rounds
(experiments/alternate.py). Prefill tokens/s comes from runs with max_new_tokens=1 (one prefill step per
request); decode tokens/s from the extra time of runs with max_new_tokens=1+G over the prefill-only run of
the same round. Ratios are contract time / plain time (>1: contract is slower). Also measured: the bytes
each bf16 model holds (weights, the copies its kernels keep, a KV pool of fixed size), decode time per
token at growing contexts (one request), the decode of one request alone (what one stream of a server
sees: its per-op times, and one row through a weight as plain linear, the contract's compiled GEMV and
its torch path), and where the contract's time goes. Every performance target is printed as measured /
target; results/bench_engine.json gets it all.

    .venv/bin/python experiments/bench/bench_engine.py [--models tiny,large] [--dtypes bfloat16,float32]
        [--threads 1] [--repeats 5] [--contexts 128,512,2048,4096]

`--one-stream`: only the decode of one request, ms per step, plain against the contract (`ordered`),
contract v1 (`invariant`) and v1 with its compiled few-row products off (its torch path: what runs
without a C++ compiler, the same bits); printed, nothing written.

`--bits`: one hash of the engine's sampled tokens and fp32 logprob bytes over varied workloads (the tiny
model and a 256-hidden GQA model, bf16 and fp32, fp32 and bf16 logits, 1-16 requests with ragged
prompts, staggered arrivals, chunked prefill or not; each batch's first request also scored by the
full-forward reference, asserted equal and hashed). Run it before and after a speed change: the hashes
must be equal.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import alternate, median_of, median_ratio  # noqa: E402
from op_timer import timed_ops  # noqa: E402
from perf_targets import CONTEXT_RATIO, ENGINE_RATIO, MEMORY_RATIO, Check, report, with_launch_environment  # noqa: E402
from shapes import CPU_256, CPU_1024  # noqa: E402

from tonpolicy.config.model import ModelConfig  # noqa: E402
from tonpolicy.kernels import get_kernels  # noqa: E402
from tonpolicy.kernels.invariant import exact_gemm, exact_gemv  # noqa: E402
from tonpolicy.model import Qwen3, init_state_dict  # noqa: E402
from tonpolicy.model.kv_cache import KVPool  # noqa: E402
from tonpolicy.rollout.engine import Engine, GenRequest  # noqa: E402
from tonpolicy.rollout.engine.logits import score_logprobs  # noqa: E402

MODELS = {
    "tiny": (ModelConfig(), dict(requests=16, prompt=200, gen=32)),
    "large": (CPU_1024, dict(requests=16, prompt=128, gen=16)),
}
# The contract's kernel set (v2; `invariant` is v1) and the plain control.
CONTRACT = "ordered"
KINDS = (CONTRACT, "plain")
# Also measured in bf16: the contract with contract.logits_dtype=bfloat16 (the LM head on the bf16 GEMM).
BF16_LOGITS = "contract_bf16_logits"
TORCH_PATH = "_torch_path"


def _prefill_s(pair: tuple[float, float]) -> float:
    return pair[0]


def _decode_s(pair: tuple[float, float]) -> float:
    return pair[1]


POOL = dict(slots=16, capacity=1024)  # the fixed KV pool the memory comparison counts


def _requests(cfg: ModelConfig, n: int, prompt: int, gen: int) -> list[GenRequest]:
    rng = random.Random(0)
    return [GenRequest([rng.randrange(cfg.vocab_size) for _ in range(prompt)], gen, seed=i) for i in range(n)]


# Shortest measurement: a run shorter than this (the tiny model's prefill) is repeated and
# averaged, so one scheduler hiccup on a shared machine does not decide a cell.
MIN_MEASURE_S = 0.6


def _time(model: Qwen3, reqs: list[GenRequest], chunk: int | None = None, min_s: float = 0.0) -> float:
    """Seconds of one generate() of `reqs` (the mean of as many runs as take `min_s`)."""
    runs, t0 = 0, time.perf_counter()
    while True:
        Engine(model, max_running_requests=len(reqs), chunked_prefill_size=chunk).generate(reqs)
        runs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s:
            return elapsed / runs


KERNEL_OPS = (
    "linear",
    "linear_k_sharded",
    "lm_head",
    "attention_pooled",
    "rms_norm",
    "swiglu",
    "apply_rope_qk",
    "rope_cos_sin",
    "logprobs",
)


def breakdown(model: Qwen3, reqs: list[GenRequest]) -> dict[str, float]:
    """Where the time goes: the share of one generate() call's wall time inside each kernel op."""
    with timed_ops(model.kernels, KERNEL_OPS) as spent:
        total = _time(model, reqs)
    spent["other (engine, sampling, glue)"] = total - sum(spent.values())
    return {n: t / total for n, t in spent.most_common()}


def held_bytes(model: Qwen3) -> int:
    """Bytes a model holds once warm: its weights, the copies it and its kernels keep (fused QKV and
    gate/up, the padded LM head, fp32 weight copies), and a KV pool of POOL size in its cache dtype."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
    for _, t in model._fused.values():
        add(t)
    if model._lm_cache is not None:
        add(model._lm_cache[1])
    cfg = model.cfg
    dtype = model.kernels.kv_cache_dtype(model.dtype)
    pool = KVPool(cfg.num_layers, POOL["slots"], POOL["capacity"], cfg.num_kv_heads, cfg.head_dim, dtype, 32)
    for t in pool.k + pool.v:
        add(t)
    return sum(storages.values())


def _kernels(kind: str):  # noqa: ANN202
    return get_kernels(CONTRACT, logits_dtype="bfloat16") if kind == BF16_LOGITS else get_kernels(kind)


def bench(name: str, dtype: torch.dtype, repeats: int) -> dict:
    cfg, w = MODELS[name]
    sd = init_state_dict(cfg, dtype, seed=0)
    pre = _requests(cfg, w["requests"], w["prompt"], 1)
    full = _requests(cfg, w["requests"], w["prompt"], 1 + w["gen"])
    kinds = [*KINDS, *([BF16_LOGITS] if dtype == torch.bfloat16 else [])]
    models, memory = {}, {}
    for k in kinds:
        models[k] = Qwen3(cfg, _kernels(k), dtype, state_dict=sd)
        _time(models[k], pre[:1])  # warm-up: builds every cache the kernels keep
        memory[k] = held_bytes(models[k])

    # Each round: a prefill-only run, then the decode's time from that round's own pair of runs.
    def measure(k: str, _round: int) -> tuple[float, float]:
        tp = _time(models[k], pre, min_s=MIN_MEASURE_S)
        return tp, max(_time(models[k], full, min_s=MIN_MEASURE_S) - tp, 1e-9)

    rounds = alternate(kinds, repeats, measure)
    out: dict = {"workload": w, "hidden": cfg.hidden_size, "layers": cfg.num_layers, "bytes": memory}
    for k in kinds:
        out[f"{k}_prefill_tok_s"] = w["requests"] * w["prompt"] / median_of(rounds, k, _prefill_s)
        out[f"{k}_decode_tok_s"] = w["requests"] * w["gen"] / median_of(rounds, k, _decode_s)
    out["prefill_ratio"] = median_ratio(rounds, CONTRACT, "plain", _prefill_s)
    out["decode_ratio"] = median_ratio(rounds, CONTRACT, "plain", _decode_s)
    out["memory_ratio"] = memory[CONTRACT] / memory["plain"]
    if BF16_LOGITS in models:
        out["bf16_logits_decode_ratio"] = median_ratio(rounds, BF16_LOGITS, "plain", _decode_s)
        out["bf16_logits_memory_ratio"] = memory[BF16_LOGITS] / memory["plain"]
    out["profile"] = {k: {"prefill": breakdown(m, pre), "full": breakdown(m, full)} for k, m in models.items()}
    out["one_request"] = one_request(models, cfg, w["prompt"], w["gen"], repeats)
    return out


def step_s(model: Qwen3, pre: list[GenRequest], full: list[GenRequest], gen: int, torch_path: bool = False) -> float:
    """Seconds per decode step of one request: a run of 1 + gen tokens less a prefill-only run, over gen.
    `torch_path`: with the compiled few-row products off (what runs without a C++ compiler; the same bits)."""
    saved = exact_gemv.kernel()
    if torch_path:
        exact_gemv._lib[0] = None
    try:
        return (_time(model, full, min_s=MIN_MEASURE_S) - _time(model, pre, min_s=MIN_MEASURE_S)) / gen
    finally:
        exact_gemv._lib[0] = saved


def one_request_rounds(models: dict[str, Qwen3], cfg: ModelConfig, prompt: int, gen: int, repeats: int) -> list:
    """Seconds per decode step of one request for each variant, alternated over `repeats` rounds; a variant
    named `<kernel set>_torch_path` is that set's model with its compiled products off."""
    pre, full = _requests(cfg, 1, prompt, 1), _requests(cfg, 1, prompt, 1 + gen)

    def measure(v: str, _round: int) -> float:
        return step_s(models[v.removesuffix(TORCH_PATH)], pre, full, gen, torch_path=v.endswith(TORCH_PATH))

    return alternate(list(models) + [f"{k}{TORCH_PATH}" for k in models if k == "invariant"], repeats, measure)


def one_request(models: dict[str, Qwen3], cfg: ModelConfig, prompt: int, gen: int, repeats: int) -> dict:
    """Decode of a single request (what one stream of a server sees): ms per decode step for each kernel
    set, and the ms per step of each kernel op."""
    rounds = one_request_rounds(models, cfg, prompt, gen, repeats)
    out: dict = {"decode_ms": {k: median_of(rounds, k) * 1e3 for k in models}, "op_ms": {}}
    full = _requests(cfg, 1, prompt, 1 + gen)
    for k, m in models.items():
        total = _time(m, full, min_s=MIN_MEASURE_S)
        out["op_ms"][k] = {n: share * total / (gen + 1) * 1e3 for n, share in breakdown(m, full).items()}
    out["decode_ratio"] = median_ratio(rounds, CONTRACT, "plain")
    if BF16_LOGITS in models:
        out["bf16_logits_decode_ratio"] = median_ratio(rounds, BF16_LOGITS, "plain")
    out["row_tile"] = row_tile_cost(cfg, next(iter(models.values())).dtype)
    return out


def row_tile_cost(cfg: ModelConfig, dtype: torch.dtype, calls: int = 100) -> dict:
    """One decode row through one MLP-sized weight [intermediate, hidden], in us: the plain 1-row linear,
    the contract's compiled GEMV (tonpolicy.kernels.invariant.exact_gemv: the weight read in its own dtype), and
    exact_gemm's torch path (the cached fp64 integer weight; what runs without a C++ compiler)."""
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size).to(dtype)
    x = torch.randn(1, cfg.hidden_size).to(dtype)
    qb, scale, bits_a, slices = exact_gemm.quantized_weight(w, 1, dtype)
    fns = {
        "plain_us": lambda: torch.nn.functional.linear(x, w),
        "contract_gemv_us": lambda: exact_gemv.linear_partials(x, w, 1),
        "contract_torch_path_us": lambda: exact_gemm.exact_matmul(x[None], qb, scale, bits_a, slices),
    }
    cost: dict = {"weight": list(w.shape), "gemv_compiled": exact_gemv.kernel() is not None}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(3):  # best of 3: the least disturbed by a shared machine
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        cost[name] = best
    return cost


def context_scaling(name: str, dtype: torch.dtype, contexts: list[int], repeats: int, gen: int = 16) -> dict:
    """Decode time per token of one request at each context length: the median engine step time over
    its `gen` decode steps (prefill chunked at 512 tokens, not counted), then the median over `repeats`
    rounds that alternate contexts and kernel sets (so machine drift hits every cell alike)."""
    cfg = replace(MODELS[name][0], max_position_embeddings=max(contexts) + gen + 64)
    sd = init_state_dict(cfg, dtype, seed=0)
    models = {k: Qwen3(cfg, get_kernels(k), dtype, state_dict=sd) for k in KINDS}

    def measure(cell: str, _round: int) -> float:
        k, ctx = cell.split("@")
        engine = Engine(models[k], max_running_requests=1, chunked_prefill_size=512)
        engine.add(_requests(cfg, 1, int(ctx), 1 + gen)[0])
        steps = []
        while engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return statistics.median(steps[-gen:])

    rounds = alternate([f"{k}@{ctx}" for ctx in contexts for k in KINDS], repeats, measure)
    return {k: {ctx: median_of(rounds, f"{k}@{ctx}") for ctx in contexts} for k in KINDS}


def one_stream(model_names: list[str], dtypes: list[str], rounds: int) -> None:
    """Print ms per decode step of one request for each variant, and each variant's time over plain."""
    print(f"load average {os.getloadavg()[0]:.1f}; compiled products: {exact_gemv.kernel() is not None}")
    for name in model_names:
        for dt in dtypes:
            cfg, work = MODELS[name]
            dtype = getattr(torch, dt)
            sd = init_state_dict(cfg, dtype, seed=0)
            models = {k: Qwen3(cfg, get_kernels(k), dtype, state_dict=sd) for k in ("plain", CONTRACT, "invariant")}
            for m in models.values():
                _time(m, _requests(cfg, 1, work["prompt"], 1 + work["gen"]))  # warm-up: every cache the kernels keep
            per_round = one_request_rounds(models, cfg, work["prompt"], work["gen"], rounds)
            cells = []
            for v in per_round[0]:
                ms = median_of(per_round, v) * 1e3
                ratio = median_ratio(per_round, v, "plain")
                verdict = "" if v == "plain" else f" {ratio:.2f}x {'pass' if ratio <= ENGINE_RATIO else 'MISS'}"
                cells.append(f"{v} {ms:.2f}{verdict}")
            print(f"{name} {dt}, ms per decode step (/plain): " + " | ".join(cells), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


PROMPT_LENS = [1, 3, 8, 31, 33, 70, 130]


def engine_bits_hash() -> str:
    """sha256 over the sampled tokens and fp32 logprob bytes of the engine on contract v1 (see --bits)."""
    h = hashlib.sha256()
    for cfg in (ModelConfig(), CPU_256):
        for dtype in (torch.bfloat16, torch.float32):
            for logits in ("float32", "bfloat16") if dtype == torch.bfloat16 else ("float32",):
                model = Qwen3(cfg, get_kernels("invariant", logits_dtype=logits), dtype, init_state_dict(cfg, dtype, 1))
                rng = random.Random(0)
                for n, chunk in ((1, None), (5, None), (7, 24), (16, None)):
                    reqs = [
                        GenRequest(
                            [rng.randrange(cfg.vocab_size) for _ in range(rng.choice(PROMPT_LENS))],
                            rng.choice([1, 5, 20, 40]),
                            seed=i,
                            arrival_step=rng.choice([0, 0, 2, 5]),
                        )
                        for i in range(n)
                    ]
                    out = Engine(model, max_running_requests=8, chunked_prefill_size=chunk).generate(reqs)
                    for r in out:
                        h.update(str(r.output_ids).encode())
                        h.update(r.output_logprobs.numpy().tobytes())
                    ref = score_logprobs(model, reqs[0].prompt_ids, out[0].output_ids, 1.0)
                    assert torch.equal(ref, out[0].output_logprobs), (cfg.name, dtype, logits, n, chunk)
                    h.update(ref.numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--contexts", default="128,512,2048,4096")
    ap.add_argument("--context-model", default="large", help="model for the context sweep ('' skips it)")
    ap.add_argument(
        "--quick", action="store_true", help="1 repeat, 4 requests of the large model, the context sweep on tiny"
    )
    ap.add_argument("--one-stream", action="store_true", help="only one request's decode, four variants")
    ap.add_argument("--bits", action="store_true", help="print the hash of the engine's outputs, nothing else")
    args = ap.parse_args()
    if args.bits:
        torch.set_num_threads(args.threads)
        print(engine_bits_hash())
        return
    if args.one_stream:
        torch.set_num_threads(args.threads)
        one_stream(args.models.split(","), args.dtypes.split(","), args.repeats)
        return
    if args.quick:
        global MIN_MEASURE_S
        args.repeats, args.contexts, args.context_model, MIN_MEASURE_S = 1, "512,4096", "tiny", 0.3
        MODELS["large"] = (MODELS["large"][0], dict(MODELS["large"][1], requests=4))
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} repeats={args.repeats}")
    checks: list[Check] = []
    data: dict = {"threads": args.threads, "runs": {}}
    for dt in args.dtypes.split(","):
        dtype = getattr(torch, dt)
        short = "bf16" if dtype == torch.bfloat16 else "fp32"
        for name in args.models.split(","):
            r = bench(name, dtype, args.repeats)
            data["runs"][f"{name}/{short}"] = r
            print(
                f"{name:6s} {short} (hidden {r['hidden']}, {r['layers']} layers): prefill tok/s contract "
                f"{r[f'{CONTRACT}_prefill_tok_s']:.0f} plain {r['plain_prefill_tok_s']:.0f} ratio "
                f"{r['prefill_ratio']:.2f}x | decode tok/s contract {r[f'{CONTRACT}_decode_tok_s']:.1f} plain "
                f"{r['plain_decode_tok_s']:.1f} ratio {r['decode_ratio']:.2f}x | memory "
                f"{r['bytes'][CONTRACT] / 2**20:.1f} / {r['bytes']['plain'] / 2**20:.1f} MiB"
            )
            prof = r["profile"][CONTRACT]["full"]
            print("    contract, where the time goes: " + ", ".join(f"{n} {s:.0%}" for n, s in prof.items()))
            one = r["one_request"]
            ms = ", ".join(f"{k} {t:.1f}" for k, t in one["decode_ms"].items())
            ops = one["op_ms"]
            by_op = ", ".join(f"{n} {t:.2f}/{ops['plain'].get(n, 0.0):.2f}" for n, t in ops[CONTRACT].items())
            tile = one["row_tile"]
            print(f"    one request, ms per decode step: {ms} (ratio {one['decode_ratio']:.2f}x)")
            print(f"    one request, ms per step by op (contract/plain): {by_op}")
            print(
                f"    one row through a {tuple(tile['weight'])} weight: plain {tile['plain_us']:.0f} us, contract "
                f"GEMV {tile['contract_gemv_us']:.0f} us, contract torch path {tile['contract_torch_path_us']:.0f} us"
            )
            checks.append(
                Check(f"engine {name} {short} prefill, contract/plain time", r["prefill_ratio"], ENGINE_RATIO)
            )
            checks.append(Check(f"engine {name} {short} decode, contract/plain time", r["decode_ratio"], ENGINE_RATIO))
            label = f"engine {name} {short} decode at one request, contract/plain time"
            checks.append(Check(label, r["one_request"]["decode_ratio"], ENGINE_RATIO))
            if dtype == torch.bfloat16:
                checks.append(Check(f"memory {name} bf16, contract/plain bytes", r["memory_ratio"], MEMORY_RATIO))
                print(
                    f"    with contract.logits_dtype=bfloat16: decode ratio {r['bf16_logits_decode_ratio']:.2f}x, "
                    f"memory ratio {r['bf16_logits_memory_ratio']:.2f}x"
                )
                label = f"engine {name} bf16 decode, contract (logits_dtype=bfloat16)/plain time"
                checks.append(Check(label, r["bf16_logits_decode_ratio"], ENGINE_RATIO))
                label = f"engine {name} bf16 decode at one request, contract (logits_dtype=bfloat16)/plain time"
                checks.append(Check(label, r["one_request"]["bf16_logits_decode_ratio"], ENGINE_RATIO))
    if args.context_model:
        contexts = [int(c) for c in args.contexts.split(",")]
        dtype = getattr(torch, args.dtypes.split(",")[0])
        sweep = context_scaling(args.context_model, dtype, contexts, args.repeats)
        data["context"] = {"model": args.context_model, "dtype": str(dtype), "per_token_s": sweep}
        for k, per in sweep.items():
            cells = ", ".join(f"{c}: {1 / t:.1f} tok/s ({t * 1e3:.1f} ms)" for c, t in per.items())
            print(f"context sweep {args.context_model} {k}: {cells}")
        if 512 in contexts and 4096 in contexts:
            for k in KINDS:
                ratio = sweep[k][4096] / sweep[k][512]
                checks.append(Check(f"decode per token at 4096 / 512 context ({k})", ratio, CONTEXT_RATIO))
    report("bench_engine", checks, data)


if __name__ == "__main__":
    with_launch_environment()
    main()
