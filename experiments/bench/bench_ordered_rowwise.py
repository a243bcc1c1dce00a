"""Ordered row-wise ops (tonpolicy.kernels.invariant.ordered_rowwise, contract v2) against the torch ops they replace
(tonpolicy.kernels.pointwise, torch.exp): median time per call over alternated rounds (experiments/alternate.py)
and the median of the rounds' own ratios, on the chosen path, at `--threads` threads.

    .venv/bin/python experiments/bench/bench_ordered_rowwise.py [--threads 2] [--rounds 15] [--min-ms 20]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: the helpers the scripts share

from alternate import compare_calls, median_of, median_ratio  # noqa: E402

from tonpolicy.cpu_numerics import cpu_info  # noqa: E402
from tonpolicy.kernels import pointwise  # noqa: E402
from tonpolicy.kernels.invariant import ordered_rowwise as rw  # noqa: E402


def cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in (64, 512):
        x = torch.randn(rows, 1024, generator=g).bfloat16()
        w = torch.randn(1024, generator=g).bfloat16()
        out.append(
            (f"rms_norm bf16 [{rows}, 1024]", lambda x=x, w=w: rw.rms_norm(x, w, 1e-6),
             lambda x=x, w=w: pointwise.rms_norm(x, w, 1e-6))
        )  # fmt: skip
    x = torch.randn(512, 1024, generator=g)
    w = torch.randn(1024, generator=g)
    out.append(("rms_norm fp32 [512, 1024]", lambda: rw.rms_norm(x, w, 1e-6), lambda: pointwise.rms_norm(x, w, 1e-6)))
    gate = torch.randn(512, 3072, generator=g).bfloat16()
    up = torch.randn(512, 3072, generator=g).bfloat16()
    out.append(("swiglu bf16 [512, 3072]", lambda: rw.swiglu(gate, up), lambda: pointwise.swiglu(gate, up)))
    for v in (152064, 2003):
        logits = torch.randn(64, v, generator=g) * 3
        tok = torch.randint(0, v, (64,), generator=g)
        out.append(
            (f"logprobs fp32 [64, {v}]", lambda lg=logits, t=tok, v=v: rw.logprobs(lg, t, v, 1.0),
             lambda lg=logits, t=tok, v=v: pointwise.logprobs(lg, t, v, 1.0))
        )  # fmt: skip
        out.append(
            (f"logprobs fp32 [64, {v}] T=0.7", lambda lg=logits, t=tok, v=v: rw.logprobs(lg, t, v, 0.7),
             lambda lg=logits, t=tok, v=v: pointwise.logprobs(lg, t, v, 0.7))
        )  # fmt: skip
    e = torch.randn(1 << 20, generator=g) * 10
    buf1, buf2 = e.clone(), e.clone()
    out.append(
        ("exp fp32 1M (out of place)", lambda: rw.exp(e), lambda: torch.exp(e)),
    )
    out.append(("exp_ fp32 1M (in place)", lambda: rw.exp_(buf1.copy_(e)), lambda: buf2.copy_(e).exp_()))
    s = torch.randn(4096, 32, generator=g)
    out.append(("row_sum fp32 [4096, 32]", lambda: rw.row_sum(s), lambda: s.sum(-1)))
    t = torch.randn(8, 32, generator=g)
    out.append(("exp_ fp32 [8, 32] (call overhead)", lambda: rw.exp_(t), lambda: t.exp_()))
    pos = torch.arange(4096)
    out.append(
        ("rope_cos_sin 4096 x 128 (uncached)", lambda: rw.rope_cos_sin(pos, 128, 1e6),
         lambda: (pointwise._rope_cache.clear(), pointwise.rope_cos_sin(pos, 128, 1e6)))
    )  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-ms", type=float, default=20.0, help="time per op per round (at least one call)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rw.require()
    info = cpu_info()
    print(f"CPU: {info.get('model_name', '?')}; torch {torch.__version__} capability "
          f"{torch.backends.cpu.get_cpu_capability()}; ordered_rowwise path {rw.chosen_path()}; "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'op':40s} {'ours ms':>10s} {'torch ms':>10s} {'ours/torch':>11s}")
    for name, ours, theirs in cases():
        times = compare_calls({"ours": ours, "torch": theirs}, args.rounds, args.min_ms / 1e3)
        a, b = median_of(times, "ours"), median_of(times, "torch")
        print(f"{name:40s} {a * 1e3:10.4f} {b * 1e3:10.4f} {median_ratio(times, 'ours', 'torch'):10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
