"""Run under the SGLang environment's Python: drive a running SGLang server the way GRPO does and
score every sampled token with tonpolicy's own full-forward model (same kernels, one full sequence,
no KV cache). Prints one JSON line: tokens, mismatched (fp32 bit patterns), max |Δ|, cached tokens.

    python tests/sglang_check.py URL CHECKPOINT DTYPE KERNELS TEMPERATURE
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf
from tonpolicy.model.qwen3 import Qwen3


def generate(url: str, ids: list[int], seed: int, temperature: float, max_new: int) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": temperature, "sampling_seed": seed},
    }
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


def main() -> None:
    url, ckpt, dtype, kernels, temperature = (
        sys.argv[1],
        sys.argv[2],
        sys.argv[3],
        sys.argv[4],
        float(sys.argv[5]),
    )
    cfg, sd = load_hf(ckpt)
    rng = random.Random(0)
    shared = [rng.randrange(cfg.vocab_size) for _ in range(150)]
    # GRPO-like: groups sharing a prompt (radix cache hits), prefixes of one another, long prompts
    # split by chunked prefill, a one-token prompt; all sent at once (continuous batching), twice.
    prompts = [shared[:n] for n in (3, 40, 40, 70, 150, 5, 33)]
    prompts += [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (1, 64, 100)]
    prompts = prompts * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda a: generate(url, a[1], a[0], temperature, 20), enumerate(prompts)))
    model = Qwen3(cfg, get_kernels(kernels), getattr(torch, dtype), sd)
    tokens = mismatched = cached = 0
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        response = out["output_ids"]
        served = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float32)
        logits = model(torch.tensor(prompt + response))
        ours = model.kernels.logprobs(logits[len(prompt) - 1 : -1], torch.tensor(response), cfg.vocab_size, temperature)
        tokens += len(response)
        mismatched += int((ours.view(torch.int32) != served.view(torch.int32)).sum())
        worst = max(worst, float((ours - served).abs().max()))
        cached += out["meta_info"].get("cached_tokens", 0)
    print(json.dumps({"tokens": tokens, "mismatched": mismatched, "max_abs_diff": worst, "cached_tokens": cached}))


if __name__ == "__main__":
    main()
