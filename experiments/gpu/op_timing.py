"""Contract / plain op timings on one CUDA GPU for gpu/triton_check.py: eager launches timed by CUDA
events, or launches captured in a CUDA graph (what a graph-replayed decode step pays per op)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tonpolicy.kernels import get_kernels


def bench(fn, *args: Any, reps: int = 20, **kw: Any) -> float:  # noqa: ANN001
    """Median seconds per call fn(*args, **kw) (CUDA events), after warm-up."""
    for _ in range(3):
        fn(*args, **kw)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args, **kw)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_bench(fn, *args: Any, calls: int = 20, reps: int = 10, **kw: Any) -> float:  # noqa: ANN001
    """Median seconds per call with `calls` calls captured in one CUDA graph: what a decode step in a
    graph pays, without the per-launch host overhead that `bench` includes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's graph notes ask
        for _ in range(3):
            fn(*args, **kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args, **kw)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def op_ratios(timer: Callable, seed: int, rows: tuple, prefill: tuple, decode: tuple, dev: str = "cuda") -> dict:
    """Contract / plain time per op, both timed by `timer`: the four linears of a Qwen3-4B layer at each
    M in `rows`, causal prefill attention over each length in `prefill`, pooled decode attention for each
    (batch, context) in `decode`."""
    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, Any] = {}
    shapes = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}
    for m in rows:
        tot_c = tot_p = 0.0
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, device=dev, generator=g).bfloat16()
            w = (torch.randn(n, k, device=dev, generator=g) / 50).bfloat16()
            tc, tp = timer(kern.linear, x, w), timer(F.linear, x, w)
            out[f"linear_{name}_m{m}"] = {"contract_ms": tc * 1e3, "plain_ms": tp * 1e3, "ratio": tc / tp}
            tot_c, tot_p = tot_c + tc, tot_p + tp
        out[f"linear_layer_m{m}_ratio"] = tot_c / tot_p
    hq, hkv, d, scale = 32, 8, 128, 128**-0.5
    for n in prefill:
        q, k, v = (torch.randn(n, h, d, device=dev, generator=g).bfloat16() for h in (hq, hkv, hkv))
        pos = torch.arange(n, device=dev)
        sq, sk, sv = (t.transpose(0, 1)[None] for t in (q, k, v))
        tc = timer(kern.attention, q, k, v, pos, pos, scale)
        tp = timer(F.scaled_dot_product_attention, sq, sk, sv, is_causal=True, scale=scale, enable_gqa=True)
        out[f"attention_prefill_{n}"] = {"contract_ms": tc * 1e3, "plain_ms": tp * 1e3, "ratio": tc / tp}
    for b, ctx in decode:
        kp = torch.randn(b, ctx, hkv, d, device=dev, generator=g).bfloat16()
        vp = torch.randn(b, ctx, hkv, d, device=dev, generator=g).bfloat16()
        qd = torch.randn(b, 1, hq, d, device=dev, generator=g).bfloat16()
        qpos = torch.full((b, 1), ctx - 1, device=dev)
        slots = torch.arange(b, device=dev)
        tc = timer(kern.attention_pooled, qd, qpos, kp, vp, slots, ctx, scale)
        kt, vt, qt = kp.transpose(1, 2), vp.transpose(1, 2), qd.transpose(1, 2)
        tp = timer(F.scaled_dot_product_attention, qt, kt, vt, scale=scale, enable_gqa=True)
        out[f"attention_decode_b{b}_ctx{ctx}"] = {"contract_ms": tc * 1e3, "plain_ms": tp * 1e3, "ratio": tc / tp}
    return out
