"""How far contract.quant=fp8_block moves the model from v2, and what it costs on this CPU.

The same random-init weights are scored teacher-forced by the embedded engine's model under the ordered
(v2) kernels and under fp8_block: per position, the KL divergence KL(v2 || fp8) of the next-token
distributions over the real vocabulary, whether the greedy tokens agree, the largest |logprob difference|
of the next token, and each forward's wall time (no speed-up is expected on a CPU: the FP8 GEMM is built
from the v2 chains plus the quantization). Random weights, not a trained model: the numbers say how big
the quantization noise is at these widths, not how a trained checkpoint degrades.

    python experiments/fp8_distance.py --model tiny
    python experiments/fp8_distance.py --model cpu_1024 --prompts 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import CPU_1024  # noqa: E402

from tonpolicy.config.model import ModelConfig  # noqa: E402
from tonpolicy.kernels import get_kernels  # noqa: E402
from tonpolicy.model.checkpoint import init_state_dict  # noqa: E402
from tonpolicy.model.qwen3 import Qwen3  # noqa: E402

MODELS = {"tiny": ModelConfig(), "cpu_1024": CPU_1024}


def score(model: Qwen3, seqs: list[torch.Tensor], vocab: int) -> tuple[list[torch.Tensor], float]:
    out, t0 = [], time.perf_counter()
    for s in seqs:
        out.append(torch.log_softmax(model(s)[:, :vocab].float(), dim=-1))
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = p.parse_args(argv)
    cfg, dtype = MODELS[a.model], getattr(torch, a.dtype)
    sd = init_state_dict(cfg, dtype, 0)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (a.length,), generator=g) for _ in range(a.prompts)]
    v2 = Qwen3(cfg, get_kernels("ordered"), dtype, sd)
    fp8 = Qwen3(cfg, get_kernels("ordered", quant="fp8_block"), dtype, sd)
    score(v2, seqs[:1], cfg.vocab_size), score(fp8, seqs[:1], cfg.vocab_size)  # warm the weight caches
    ref, t_v2 = score(v2, seqs, cfg.vocab_size)
    got, t_fp8 = score(fp8, seqs, cfg.vocab_size)
    r, q = torch.cat(ref), torch.cat(got)
    kl = (r.exp() * (r - q)).sum(-1)
    agree = (r.argmax(-1) == q.argmax(-1)).float().mean().item()
    nxt = torch.cat([s[1:] for s in seqs])
    rows = torch.cat([torch.arange(len(s) - 1) + i * a.length for i, s in enumerate(seqs)])
    diff = (r[rows, nxt] - q[rows, nxt]).abs()
    print(f"model {a.model} ({cfg.hidden_size} hidden, {cfg.num_layers} layers), {a.dtype}, {len(r)} positions")
    print(f"KL(v2 || fp8) per position: mean {kl.mean().item():.3e}, max {kl.max().item():.3e}")
    print(f"greedy agreement: {agree:.4f}")
    print(f"|logprob diff| of the next token: mean {diff.mean().item():.3e}, max {diff.max().item():.3e}")
    print(f"forward wall time, {len(seqs)} x {a.length} tokens: v2 {t_v2:.2f} s, fp8_block {t_fp8:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
