"""The GEMM and trainer rows of the GPU speed table: the `triton` set's linears against cuBLAS (`F.linear`)
at Qwen3-4B's layer shapes, and the Megatron trainer's step with the kernel spec against the stock spec.

Linears are called as the model calls them: QKV and gate/up `kernels.linear` (K whole), o_proj and down
`kernels.linear_k_sharded` (canonical K-shards). Prefill: 4096 rows, eager launches timed by CUDA
events. Decode: 1, 8, 32 and 128 rows, launches captured in a CUDA graph (what a graph-replayed decode
step pays). Each row: contract and cuBLAS milliseconds summed over the layer's four linears, their
ratio, the issue's target and whether it is met. The trainer row: one PPO step's seconds, kernels /
stock, on a two-layer model with Qwen3-4B's layer shapes (bf16). With `smoke` (CPU, Triton's
interpreter): tiny shapes timed by the wall clock, to check the script, not the speed."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tonpolicy.kernels import get_kernels

# Targets: contract time / cuBLAS's (linears), kernel spec's step / stock spec's (trainer).
TARGETS = {"linear_prefill": 1.15, "linear_decode": 1.25, "trainer_step": 1.1}
# Qwen3-4B: hidden 2560, 32 x 128 query heads, 8 KV heads, intermediate 9728. (K, N, row-parallel)
QWEN3_4B_LINEARS = {
    "qkv": (2560, 6144, False),
    "o": (4096, 2560, True),
    "gate_up": (2560, 19456, False),
    "down": (9728, 2560, True),
}
SMOKE_LINEARS = {"qkv": (256, 160, False), "o": (256, 64, True)}


def _wall(fn: Callable, *args: Any, **kw: Any) -> float:
    t = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t


def _row(contract_s: float, base_s: float, target: float) -> dict[str, Any]:
    ratio = contract_s / base_s
    return {
        "contract_ms": contract_s * 1e3,
        "baseline_ms": base_s * 1e3,
        "ratio": ratio,
        "target": target,
        "met": ratio <= target,
    }


def gemm_rows(dev: str, smoke: bool) -> dict[str, Any]:
    """Per M: the layer's four linears, contract vs cuBLAS, summed (and each linear's own ratio)."""
    from op_timing import bench, graph_bench

    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator(device=dev).manual_seed(2)
    dt = torch.float32 if smoke else torch.bfloat16
    shapes = SMOKE_LINEARS if smoke else QWEN3_4B_LINEARS
    cases = {"prefill": ((8,) if smoke else (4096,), _wall if smoke else bench, TARGETS["linear_prefill"])}
    cases["decode"] = ((1, 3) if smoke else (1, 8, 32, 128), _wall if smoke else graph_bench, TARGETS["linear_decode"])
    weights = {
        name: (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dt) for name, (k, n, _) in shapes.items()
    }
    out: dict[str, Any] = {}
    for case, (ms, timer, target) in cases.items():
        for m in ms:
            tot_c = tot_b = 0.0
            per: dict[str, float] = {}
            for name, (k, _n, row_parallel) in shapes.items():
                x = torch.randn(m, k, device=dev, generator=g).to(dt)
                w = weights[name]
                fn = kern.linear_k_sharded if row_parallel else kern.linear
                tc, tb = timer(fn, x, w), timer(F.linear, x, w)
                per[name] = tc / tb
                tot_c, tot_b = tot_c + tc, tot_b + tb
            out[f"linear_{case}_m{m}"] = _row(tot_c, tot_b, target) | {"per_linear_ratio": per}
    return out


def trainer_rows(dev: str, smoke: bool) -> dict[str, Any]:
    """One PPO step (the median of 3 after a warm-up), kernel spec / stock spec, same samples."""
    from tonpolicy.align import harness
    from tonpolicy.config.model import ModelConfig
    from tonpolicy.model.checkpoint import init_state_dict, save_hf
    from tonpolicy.rl.train_samples import TrainSamples
    from tonpolicy.trainer.process_groups import Layout
    from tonpolicy.trainer.worker import TrainerWorker

    if smoke:
        cfg, dtype, dt, n, p_len, r_len = ModelConfig(num_layers=1), "float32", torch.float32, 2, 20, 12
    else:
        from shapes import QWEN3_4B_2L

        cfg = QWEN3_4B_2L
        dtype, dt, n, p_len, r_len = "bfloat16", torch.bfloat16, 8, 512, 512
    ck = str(Path(tempfile.mkdtemp()) / "ckpt")
    save_hf(init_state_dict(cfg, dt, 3), cfg, ck)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (p_len,), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(0, cfg.vocab_size, (r_len,), generator=g).tolist() for _ in range(n)]
    adv = [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(n)]
    steps: dict[str, float] = {}
    for spec in ("kernels", "stock"):
        w = TrainerWorker(harness.make_config(Layout(), dtype, "triton", 0.8, ck, device=dev), ck, spec=spec)
        lps = w.logprobs(prompts, responses)
        samples = TrainSamples(prompts, responses, lps, lps, adv)
        times = []
        for i in range(2 if smoke else 4):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            w.ppo_step(samples)
            if dev == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
        steps[spec] = sorted(times)[len(times) // 2]
        w.close()
    return {f"trainer_step_{dtype}": _row(steps["kernels"], steps["stock"], TARGETS["trainer_step"])}
