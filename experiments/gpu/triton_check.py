"""GPU proof of the `triton` kernel set, one process on one GPU (run under torchrun, NCCL).

Stages (each reported on its own; a failing stage does not stop the others), all bf16 unless named:
  linear     row invariance across M = 1..4096 (split and fused routes, row offsets), N-shard and
             TP-shard (1, 2, 4) invariance; fp32 operands too; cuBLAS's M-dependence as the control;
  attention  prefill == chunked prefill == paged decode (split-KV, batched with other sequences) == ring-CP
             chunks merged; SDPA prefill vs decode as the control;
  attention_speed  the attention rows of the speed table (gpu/attention_speed.py): decode 32 x 4096 and
             1 x 1024, prefill 4096, against SDPA and FlashAttention, each with its target;
  model      embedded engine on CUDA: decode logprobs == a full prefill; Megatron trainer TP1 on CUDA ==
             the engine bit for bit (stock spec as the control); trainer step contract / stock;
  timing     contract kernels / plain cuBLAS and SDPA in bf16 (prefill and decode shapes of Qwen3-4B).
Writes JSON to --out. Usage: experiments/gpu_check.sh (which runs this after gpu/cublas_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # experiments/ (shared helpers), repo root

from attention_speed import attention_rows  # noqa: E402
from op_timing import bench, graph_bench, op_ratios  # noqa: E402
from shapes import WIDE_4L  # noqa: E402

from tonpolicy.align import harness  # noqa: E402
from tonpolicy.kernels import get_kernels  # noqa: E402
from tonpolicy.kernels.triton import linear as tlin  # noqa: E402

REPORT: dict[str, Any] = {}
OUT = Path("gpu_triton.json")
DEV = "cuda"
# --smoke: CPU, Triton's interpreter, tiny shapes, fp32 (checks this script, not the GPU).
SMOKE = False
FULL = {
    "k": 2560,
    "n": 9728,
    "rows": 4096,
    "ms": (1, 2, 3, 7, 16, 64, 100, 128, 255, 256, 511, 512, 1000, 2048, 4096),
    "offsets": (1, 333, 3000),
    "attn": (2048, 32, 8, 128),
    "decode_at": (0, 1, 63, 64, 65, 127, 128, 129, 1023, 2047),
    "dtype": torch.bfloat16,
}
SMALL = {
    "k": 256,
    "n": 160,
    "rows": 300,
    "ms": (1, 3, 130, 300),
    "offsets": (1, 33),
    "attn": (200, 4, 2, 32),
    "decode_at": (0, 64, 128, 199),
    "dtype": torch.float32,
}
S = FULL


def stage(fn):  # noqa: ANN001, ANN201
    def run(*a: Any) -> None:
        t = time.perf_counter()
        try:
            REPORT[fn.__name__] = {"ok": True, **(fn(*a) or {})}
        except Exception:  # noqa: BLE001 - the report must say which stage failed and why
            REPORT[fn.__name__] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        REPORT[fn.__name__]["seconds"] = round(time.perf_counter() - t, 2)
        print(json.dumps({fn.__name__: REPORT[fn.__name__]}, default=str)[:6000], flush=True)
        OUT.write_text(json.dumps(REPORT, indent=2, default=str))

    return run


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rows_equal(got: torch.Tensor, want: torch.Tensor) -> int:
    """Rows whose bits differ."""
    return int((got.view(got.shape[0], -1) != want.view(want.shape[0], -1)).any(-1).sum())


@stage
def linear() -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)
    k, n, dt = S["k"], S["n"], S["dtype"]
    x = torch.randn(S["rows"], k, device=DEV, generator=g).to(dt)
    w = (torch.randn(n, k, device=DEV, generator=g) / 50).to(dt)
    full = tlin.linear(x, w, 4, dt)
    out: dict[str, Any] = {"m_rows_differing": {}, "cublas_m_rows_differing": {}}
    ref = x @ w.T
    for m in S["ms"]:
        out["m_rows_differing"][m] = _rows_equal(tlin.linear(x[:m], w, 4, dt), full[:m])
        out["cublas_m_rows_differing"][m] = _rows_equal(x[:m] @ w.T, ref[:m])
    out["offset_rows_differing"] = {
        lo: _rows_equal(tlin.linear(x[lo : lo + 200], w, 4, dt), full[lo : lo + 200]) for lo in S["offsets"]
    }
    out["n_shard_differing"] = {
        f"{lo}:{hi}": _rows_equal(tlin.linear(x[:512], w[lo:hi], 4, dt), full[:512, lo:hi])
        for lo, hi in ((0, n // 2), (n // 2, n), (10, n // 2 + 3))
    }
    tp_out = {}
    for m in (1, 64, 1024)[: 2 if SMOKE else 3]:
        for tp in (1, 2, 4):
            ks = k // tp
            stack = torch.cat(
                [tlin.partials(x[:m, r * ks : (r + 1) * ks], w[:, r * ks : (r + 1) * ks], 4 // tp) for r in range(tp)]
            )
            tp_out[f"m{m}_tp{tp}"] = _rows_equal(tlin.fold(stack, dt), full[:m])
    out["tp_shard_rows_differing"] = tp_out
    out["max_abs_vs_cublas"] = float((full.float() - ref.float()).abs().max())
    xf, wf = x[:600, :256].float(), w[:256, :256].float()
    ff = tlin.linear(xf, wf, 4, torch.float32)
    out["fp32_m_rows_differing"] = {
        m: _rows_equal(tlin.linear(xf[:m], wf, 4, torch.float32), ff[:m]) for m in (1, 17, 300)
    }
    out["all_invariant"] = not any(
        v
        for d in (
            out["m_rows_differing"],
            out["offset_rows_differing"],
            out["n_shard_differing"],
            tp_out,
            out["fp32_m_rows_differing"],
        )
        for v in d.values()
    )
    return out


@stage
def attention() -> dict:
    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator(device=DEV).manual_seed(1)
    n, hq, hkv, d = S["attn"]
    scale, dt = d**-0.5, S["dtype"]
    q, k, v = (torch.randn(n, h, d, device=DEV, generator=g).to(dt) for h in (hq, hkv, hkv))
    pos = torch.arange(n, device=DEV)
    full = kern.attention(q, k, v, pos, pos, scale)
    out: dict[str, Any] = {}
    lo, hi = n // 2, 3 * n // 4
    out["chunked_rows_differing"] = _rows_equal(
        kern.attention(q[lo:hi], k[:hi], v[:hi], pos[lo:hi], pos[:hi], scale), full[lo:hi]
    )
    cap = 2 * n
    kp = torch.randn(4, cap, hkv, d, device=DEV, generator=g).to(dt)
    vp = torch.randn(4, cap, hkv, d, device=DEV, generator=g).to(dt)
    kp[2, :n], vp[2, :n] = k, v
    dec = {}
    for i in S["decode_at"]:
        qd = torch.stack([q[i], q[5], q[i]])[:, None]
        qpos = torch.tensor([[i], [5], [i]], device=DEV)
        res = kern.attention_pooled(qd, qpos, kp, vp, torch.tensor([2, 0, 2], device=DEV), max(i + 1, 6), scale)
        dec[i] = _rows_equal(res[0], full[i : i + 1]) + _rows_equal(res[2], full[i : i + 1])
    out["decode_rows_differing"] = dec
    nb = min(512, n // 64 * 64)
    qb, kb, vb = (torch.stack([t, t.flip(0)]) for t in (q[:nb], k[:nb], v[:nb]))
    p512 = pos[:nb]
    out["batched_rows_differing"] = _rows_equal(
        kern.attention_batched(qb, kb, vb, torch.stack([p512, p512]), torch.stack([p512, p512]), scale)[0], full[:nb]
    )
    c = kern.attention_chunk  # ring CP's unit: whole chunks, merged in key order
    parts = [
        kern.attention_chunk_partial(q[:nb], k[t : t + c], v[t : t + c], p512, pos[t : t + c], scale)
        for t in range(0, nb, c)
    ]
    acc = parts[0]
    for p in parts[1:]:
        acc = kern.merge(acc, p)
    out["ring_chunks_rows_differing"] = _rows_equal(kern.finalize(acc, q.dtype), full[:nb])
    # Control: SDPA (flash) prefill vs decode rows.
    sq, sk, sv = (t.transpose(0, 1)[None] for t in (q, k, v))
    sfull = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale, enable_gqa=True)
    out["sdpa_decode_rows_differing"] = sum(
        _rows_equal(
            F.scaled_dot_product_attention(
                sq[:, :, i : i + 1], sk[:, :, : i + 1], sv[:, :, : i + 1], scale=scale, enable_gqa=True
            )[0].transpose(0, 1),
            sfull[0, :, i : i + 1].transpose(0, 1),
        )
        for i in S["decode_at"][1:]
    )
    ref = sfull[0].transpose(0, 1)
    out["max_abs_vs_sdpa"] = float((full.float() - ref.float()).abs().max())
    out["all_invariant"] = not (
        out["chunked_rows_differing"]
        or any(dec.values())
        or out["batched_rows_differing"]
        or out["ring_chunks_rows_differing"]
    )
    return out


@stage
def model(root: Path) -> dict:
    from tonpolicy.config.model import ModelConfig
    from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
    from tonpolicy.model.qwen3 import Qwen3
    from tonpolicy.rl.train_samples import TrainSamples
    from tonpolicy.trainer.process_groups import Layout
    from tonpolicy.trainer.worker import TrainerWorker

    out: dict[str, Any] = {}
    cfg = WIDE_4L
    dtypes = (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    if SMOKE:
        cfg, dtypes = ModelConfig(num_layers=2), dtypes[1:]
    for dtype_name, dt in dtypes:
        ck = str(root / f"m_{dtype_name}")
        save_hf(init_state_dict(cfg, dt, 7), cfg, ck)
        ro = harness.rollout(ck, "triton", 3 if SMOKE else 8, 40 if SMOKE else 96, 4 if SMOKE else 24, 0.8, device=DEV)
        c, sd = load_hf(ck)
        kern = get_kernels("triton", attention_tile=64)
        m = Qwen3(c, kern, dt, sd).to(DEV)
        pre = []
        for p, r in zip(ro["prompts"], ro["responses"], strict=True):
            logits = m(torch.tensor(p + r, device=DEV))[len(p) - 1 : -1]
            pre.append(kern.logprobs(logits, torch.tensor(r, device=DEV), c.vocab_size, 0.8).cpu())
        out[f"{dtype_name}_prefill_vs_decode"] = harness.compare(pre, [torch.tensor(x) for x in ro["logprobs"]])
        adv = [(-1.0) ** i * (0.5 + 0.1 * i) for i in range(len(ro["prompts"]))]
        for spec in ("kernels", "stock"):
            w = TrainerWorker(harness.make_config(Layout(), dtype_name, "triton", 0.8, ck), ck, spec=spec)
            lps = w.logprobs(ro["prompts"], ro["responses"])
            out[f"{dtype_name}_trainer_{spec}_vs_engine"] = harness.compare(lps, ro["logprobs"])
            samples = TrainSamples(ro["prompts"], ro["responses"], lps, ro["logprobs"], adv)
            times = []
            for i in range(2 if SMOKE else 4):
                _sync()
                t = time.perf_counter()
                met = w.ppo_step(samples)
                _sync()
                if i:
                    times.append(time.perf_counter() - t)
                else:
                    out[f"{dtype_name}_{spec}_first_grad_norm"] = met["grad_norm"]
            out[f"{dtype_name}_{spec}_step_s"] = sorted(times)[len(times) // 2]
            w.close()
        out[f"{dtype_name}_step_ratio"] = out[f"{dtype_name}_kernels_step_s"] / out[f"{dtype_name}_stock_step_s"]
    return out


@stage
def attention_speed() -> dict:
    return attention_rows(DEV, SMOKE)


@stage
def timing() -> dict:
    """Eager launches (CUDA events around each call)."""
    return op_ratios(bench, 2, (4096, 1, 32, 128), (4096,), ((32, 4096), (8, 1024)))


@stage
def graph_timing() -> dict:
    """Decode-sized linears and decode attention with the launches inside a CUDA graph (contract vs
    cuBLAS/SDPA, both captured): the cost a graph-replayed decode step pays per op."""
    return op_ratios(graph_bench, 3, (1, 8, 32, 128), (), ((1, 1024), (8, 1024), (32, 4096)))


class _Patched:
    """Temporarily replace a module's tile constants (the tuning sweep only; the contract's are fixed)."""

    def __init__(self, module: Any, **values: Any) -> None:
        self.module, self.values, self.saved = module, values, {}

    def __enter__(self) -> None:
        self.saved = {k: getattr(self.module, k) for k in self.values}
        for k, v in self.values.items():
            setattr(self.module, k, v)

    def __exit__(self, *exc: Any) -> None:
        for k, v in self.saved.items():
            setattr(self.module, k, v)


@stage
def tune() -> dict:
    """Other fixed configurations: time, and whether their bits equal the contract's configuration."""
    from tonpolicy.kernels.triton import attention as ta

    g = torch.Generator(device=DEV).manual_seed(3)
    out: dict[str, Any] = {}
    k, n = 2560, 19456
    xs = {m: torch.randn(m, k, device=DEV, generator=g).bfloat16() for m in (4096, 1, 32)}
    w = (torch.randn(n, k, device=DEV, generator=g) / 50).bfloat16()
    base = {m: tlin.linear(x, w, 4, torch.bfloat16) for m, x in xs.items()}
    plain = {m: bench(F.linear, x, w) for m, x in xs.items()}
    # Every member of the GEMM family at every M, fused and split-K (which member serves which M is
    # tlin.tiles_for's choice: this is the table to tune it by).
    for t in tlin.FAMILY:
        for split in (False, True):
            name = f"linear_{t.block_m}x{t.block_n}_w{t.num_warps}_s{t.num_stages}_g{t.group_m}"
            name += ("_persistent" if t.persistent else "") + ("_tma" if t.tma else "") + ("_splitk" if split else "")
            try:
                run = lambda x, t=t, split=split: tlin.linear(x, w, 4, torch.bfloat16, tiles=t, split_k=split)  # noqa: E731
                out[name] = {
                    "bits_equal_contract": all(torch.equal(run(x), base[m]) for m, x in xs.items()),
                    **{f"m{m}_ratio": bench(run, x) / plain[m] for m, x in xs.items()},
                }
            except Exception as e:  # noqa: BLE001 - a member that does not compile is a result too
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    hq, hkv, d = 32, 8, 128
    scale = d**-0.5
    q, kk, v = (torch.randn(4096, h, d, device=DEV, generator=g).bfloat16() for h in (hq, hkv, hkv))
    pos = torch.arange(4096, device=DEV)
    sq, sk, sv = (t.transpose(0, 1)[None] for t in (q, kk, v))
    t_plain = bench(F.scaled_dot_product_attention, sq, sk, sv, is_causal=True, scale=scale, enable_gqa=True)
    kern = get_kernels("triton", attention_tile=64)
    base_a = kern.attention(q, kk, v, pos, pos, scale)
    kp = kk.view(1, 4096, hkv, d).expand(32, -1, -1, -1).contiguous()
    vp = v.view(1, 4096, hkv, d).expand(32, -1, -1, -1).contiguous()
    qd = torch.randn(32, 1, hq, d, device=DEV, generator=g).bfloat16()
    qpos = torch.full((32, 1), 4095, device=DEV)
    slots = torch.arange(32, device=DEV)
    t_plain_dec = bench(
        F.scaled_dot_product_attention,
        qd.transpose(1, 2),
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        scale=scale,
        enable_gqa=True,
    )
    for bm, tile, nw, ns in ((64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 3)):
        name = f"attention_{bm}x{tile}_w{nw}_s{ns}"
        try:
            with _Patched(ta, BLOCK_M=bm, TILE=tile, NUM_WARPS=nw, NUM_STAGES=ns):
                same = torch.equal(kern.attention(q, kk, v, pos, pos, scale), base_a)
                out[name] = {
                    "bits_equal_contract": same,
                    "prefill_ratio": bench(kern.attention, q, kk, v, pos, pos, scale) / t_plain,
                    "decode_b32_ctx4096_ratio": bench(kern.attention_pooled, qd, qpos, kp, vp, slots, 4096, scale)
                    / t_plain_dec,
                }
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def main() -> None:
    global OUT, SMOKE, S, DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_triton.json")
    ap.add_argument("--stages", default="linear,attention,attention_speed,timing,graph_timing,model,tune")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes (script check)")
    a = ap.parse_args()
    OUT, SMOKE = Path(a.out), a.smoke
    if SMOKE:
        S, DEV = SMALL, "cpu"
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
    import triton

    REPORT["env"] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.is_available() and torch.cuda.get_device_name(),
    }
    stages = a.stages.split(",")
    root = Path(tempfile.mkdtemp())
    by_name = {"linear": linear, "attention": attention, "timing": timing, "graph_timing": graph_timing}
    by_name["attention_speed"] = attention_speed
    by_name |= {"model": lambda: model(root), "tune": tune}
    for name in stages:  # timing before model: a timeout then costs the slower stage
        by_name[name]()
    print("gpu_triton_check:", {k: v.get("ok") for k, v in REPORT.items() if k != "env"}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
