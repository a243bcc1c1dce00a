"""One hash of the embedded engine's outputs (sampled tokens and fp32 logprob bytes) over varied workloads,
to show that a speed change kept every bit: run it before and after, the hashes must be equal.

    .venv/bin/python experiments/engine_bits.py [--threads 1]

Workloads: the tiny model and a 256-hidden GQA model, bf16 and fp32, fp32 and bf16 logits, 1-16
requests with ragged prompts (1-130 tokens), staggered arrivals, chunked prefill or not; each batch's
first request is also scored by the full-forward reference (asserted equal, and hashed).
"""

from __future__ import annotations

import argparse
import hashlib
import random

import torch
from shapes import CPU_256

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3, init_state_dict
from tonpolicy.rollout.engine import Engine, GenRequest
from tonpolicy.rollout.engine.logits import score_logprobs

PROMPT_LENS = [1, 3, 8, 31, 33, 70, 130]


def engine_bits_hash() -> str:
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
    ap.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(ap.parse_args().threads)
    print(engine_bits_hash())


if __name__ == "__main__":
    main()
