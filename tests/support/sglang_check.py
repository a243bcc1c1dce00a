"""Run under the SGLang environment's Python: drive a running SGLang server the way GRPO does and
score every sampled token with tonpolicy's own full-forward model (same kernels, one full sequence,
no KV cache). Prints one JSON line: tokens, mismatched (fp32 bit patterns), max |Δ|, cached tokens.
The model is the checkpoint family's engine model (tonpolicy/families.py). With a sixth argument
`routes`, each request also asks for meta_info.routed_experts, compared with the full forward's routes
(ascending expert ids, -1 in dense layers): `route_rows`, `route_mismatched_rows` in the JSON. With
`small`, the prompts are sent once (not twice) and 8 tokens are sampled (slow reference models). With
`quant=Q` (a contract.quant other than none), the scorer's kernel set quantizes by Q, and the same tokens are
also scored unquantized: `control_mismatched` in the JSON, non-zero when the server really quantized.

    python tests/support/sglang_check.py URL CHECKPOINT DTYPE KERNELS TEMPERATURE [routes] [small] [quant=Q]
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf
from tonpolicy.rollout.wire.response import decode_routed_experts


def generate(url: str, ids: list[int], seed: int, temperature: float, max_new: int, routes: bool = False) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": temperature, "sampling_seed": seed},
    }
    if routes:
        body["return_routed_experts"] = True
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
    routes, small = "routes" in sys.argv[6:], "small" in sys.argv[6:]
    quant = next((a.removeprefix("quant=") for a in sys.argv[6:] if a.startswith("quant=")), "none")
    max_new = 8 if small else 20
    cfg, sd = load_hf(ckpt)
    rng = random.Random(0)
    shared = [rng.randrange(cfg.vocab_size) for _ in range(150)]
    # GRPO-like: groups sharing a prompt (radix cache hits), prefixes of one another, long prompts
    # split by chunked prefill, a one-token prompt; all sent at once (continuous batching), twice.
    prompts = [shared[:n] for n in (3, 40, 40, 70, 150, 5, 33)]
    prompts += [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (1, 64, 100)]
    prompts = prompts if small else prompts * 2
    # `small`: one prompt first, so the shared prefixes of the rest come from the radix cache.
    first = [(1, prompts[1])] if small else []
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = {i: generate(url, p, i, temperature, max_new, routes) for i, p in first}
        rest = [(i, p) for i, p in enumerate(prompts) if i not in done]
        served = pool.map(lambda a: generate(url, a[1], a[0], temperature, max_new, routes), rest)
        done |= dict(zip([i for i, _ in rest], served, strict=True))
        outs = [done[i] for i in range(len(prompts))]
    engine_model = resolve(family(cfg.family).engine_model)
    model = engine_model(cfg, get_kernels(kernels, quant=quant), getattr(torch, dtype), sd)
    control = None if quant == "none" else engine_model(cfg, get_kernels(kernels), getattr(torch, dtype), sd)
    tokens = mismatched = cached = route_rows = route_bad = control_bad = 0
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        response = out["output_ids"]
        served = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float32)
        if routes:
            model.routes = {}
        logits = model(torch.tensor(prompt + response))
        if routes:  # SGLang reports the fed positions: all but the last token
            want = torch.full((len(prompt) + len(response) - 1, cfg.num_layers, cfg.num_experts_per_tok), -1)
            for layer, r in model.routes.items():
                want[:, layer] = r.experts[:-1]
            got = torch.tensor(decode_routed_experts(out["meta_info"]["routed_experts"], *want.shape[1:]))
            route_rows += want.shape[0]
            route_bad += want.shape[0] if got.shape != want.shape else int((got != want).any(-1).any(-1).sum())
        ours = model.kernels.logprobs(logits[len(prompt) - 1 : -1], torch.tensor(response), cfg.vocab_size, temperature)
        tokens += len(response)
        mismatched += int((ours.view(torch.int32) != served.view(torch.int32)).sum())
        if control is not None:
            rows = control(torch.tensor(prompt + response))[len(prompt) - 1 : -1]
            theirs = control.kernels.logprobs(rows, torch.tensor(response), cfg.vocab_size, temperature)
            control_bad += int((theirs.view(torch.int32) != served.view(torch.int32)).sum())
        worst = max(worst, float((ours - served).abs().max()))
        cached += out["meta_info"].get("cached_tokens", 0)
    result = {"tokens": tokens, "mismatched": mismatched, "max_abs_diff": worst, "cached_tokens": cached}
    if control is not None:
        result["control_mismatched"] = control_bad
    if routes:
        result |= {"route_rows": route_rows, "route_mismatched_rows": route_bad}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
