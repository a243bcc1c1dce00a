"""The attention rows of the GPU speed table: the `triton` set's attention against SDPA and, where the
flash_attn package is installed, FlashAttention's own kernels, at Qwen3-4B's heads (32 query heads, 8 KV
heads, head_dim 128, bf16). Decode reads a KV pool (split-KV over the set's fixed chunks); prefill is
causal over one sequence. Each row: contract and baseline milliseconds, the ratio to the faster
baseline, the issue's target and whether it is met. Eager launches and launches inside a CUDA graph
(what a graph-replayed decode step pays). With `smoke` (CPU, Triton's interpreter): tiny shapes timed
by the wall clock, to check the script, not the speed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tonpolicy.kernels import get_kernels

# Targets: contract time / the faster baseline's.
TARGETS = {"decode_b32_ctx4096": 1.2, "decode_b1_ctx1024": 1.6, "prefill_4096": 1.4}


def _wall(fn: Callable, *args: Any, **kw: Any) -> float:
    t = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t


def _flash() -> Any:
    try:
        import flash_attn

        return flash_attn
    except ImportError:
        return None


def attention_rows(dev: str, smoke: bool) -> dict[str, Any]:
    from op_timing import bench, graph_bench

    timers: dict[str, Callable] = {"wall": _wall} if smoke else {"eager": bench, "graph": graph_bench}
    hq, hkv, d = (4, 2, 32) if smoke else (32, 8, 128)
    dt = torch.float32 if smoke else torch.bfloat16
    decode = (
        {"decode_b32_ctx4096": (2, 160), "decode_b1_ctx1024": (1, 130)}
        if smoke
        else {
            "decode_b32_ctx4096": (32, 4096),
            "decode_b1_ctx1024": (1, 1024),
        }
    )
    prefill = {"prefill_4096": 160 if smoke else 4096}
    kern = get_kernels("triton", attention_tile=64)
    fa = None if smoke else _flash()
    g = torch.Generator(device=dev).manual_seed(4)
    scale = d**-0.5
    out: dict[str, Any] = {"flash_attn": getattr(fa, "__version__", None) or "not installed"}
    cases: dict[str, tuple[Callable, dict[str, Callable]]] = {}
    for name, (b, ctx) in decode.items():
        kp, vp = (torch.randn(b, ctx, hkv, d, device=dev, generator=g).to(dt) for _ in range(2))
        qd = torch.randn(b, 1, hq, d, device=dev, generator=g).to(dt)
        qpos = torch.full((b, 1), ctx - 1, device=dev)
        slots = torch.arange(b, device=dev)
        qt, kt, vt = qd.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)
        base = {
            "sdpa": lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
        }
        if fa is not None:
            lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            base["flash_attn"] = lambda qd=qd, kp=kp, vp=vp, lens=lens: fa.flash_attn_with_kvcache(
                qd, kp, vp, cache_seqlens=lens, softmax_scale=scale, causal=True
            )
        contract = lambda qd=qd, qpos=qpos, kp=kp, vp=vp, slots=slots, ctx=ctx: kern.attention_pooled(  # noqa: E731
            qd, qpos, kp, vp, slots, ctx, scale
        )
        cases[name] = (contract, base)
    for name, n in prefill.items():
        q, k, v = (torch.randn(n, h, d, device=dev, generator=g).to(dt) for h in (hq, hkv, hkv))
        pos = torch.arange(n, device=dev)
        sq, sk, sv = (t.transpose(0, 1)[None] for t in (q, k, v))
        base = {
            "sdpa": lambda sq=sq, sk=sk, sv=sv: F.scaled_dot_product_attention(
                sq, sk, sv, is_causal=True, scale=scale, enable_gqa=True
            )
        }
        if fa is not None:
            base["flash_attn"] = lambda q=q, k=k, v=v: fa.flash_attn_func(
                q[None], k[None], v[None], softmax_scale=scale, causal=True
            )
        cases[name] = (lambda q=q, k=k, v=v, pos=pos: kern.attention(q, k, v, pos, pos, scale), base)
    for name, (contract, base) in cases.items():
        for how, timer in timers.items():
            if how == "graph" and name.startswith("prefill"):
                continue  # prefill is not graph-replayed
            row: dict[str, Any] = {"contract_ms": timer(contract) * 1e3}
            for b_name, fn in base.items():
                try:
                    row[f"{b_name}_ms"] = timer(fn) * 1e3
                except Exception as e:  # noqa: BLE001 - a baseline that cannot run here is a result too
                    row[f"{b_name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            best = min((v for k, v in row.items() if k.endswith("_ms") and k != "contract_ms"), default=None)
            if best:
                row["ratio"] = row["contract_ms"] / best
                row["target"] = TARGETS[name]
                row["met"] = row["ratio"] <= TARGETS[name]
            out[f"{name}_{how}"] = row
    return out
