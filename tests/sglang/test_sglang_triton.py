"""The `triton` kernel set inside released SGLang, proven on this CPU in Triton's interpreter.

SGLang's CPU engine (`.venv-sglang`: its torch, Triton 3.8) runs tonpolicy's model package on the
triton set under TRITON_INTERPRET=1 (tests/conftest.py sets it where there is no GPU; config validation
admits the triton set on a CPU only then): attention straight over SGLang's paged KV pool, RoPE from a
device table, the sampler's logprob by the set's own kernel. Each returned logprob equals, fp32 bit
for bit, tonpolicy's full forward of the same kernels in this test's own environment (`.venv`: torch
2.13 CPU, Triton 3.6's interpreter), which tests/align/test_triton_parity.py proves equal to the
Megatron trainer's at TP 1/2 and CP 2. A prompt whose prefix comes from the radix cache, and a batch of
two decoding together, are in the check. Negative control: the `plain` kernels' forward misses the
served values by a little; and SGLang's own logprob route (torch's log_softmax) differs from the set's
kernel on the same logits, so the match is not an accident of the route. Tiny on purpose (1 layer,
3 requests x 4 tokens): the interpreter is slow (about 2.5 min here on 2 loaded cores, most of it
SGLang's start).
On a GPU, experiments/gpu_check.sh runs the same through SGLang with CUDA graphs on.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from support.sglang_proc import SGLangServer, save_checkpoint, sglang_env_python

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels, pointwise
from tonpolicy.model.checkpoint import load_hf
from tonpolicy.model.qwen3 import Qwen3

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
MODEL = ModelConfig(num_layers=1)
TEMPERATURE = 0.7
NEW_TOKENS = 4


def _generate(url: str, ids: list[int], seed: int) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "sampling_seed": seed},
    }
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def _served(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float32)


def _logits(model: Qwen3, prompt: list[int], out: dict) -> torch.Tensor:
    """The full forward of prompt + response: the logits that scored each response token."""
    return model(torch.tensor(prompt + out["output_ids"]))[len(prompt) - 1 : -1]


def _mismatch(served: torch.Tensor, ours: torch.Tensor) -> tuple[int, float]:
    """(tokens whose fp32 bits differ, max |diff|)."""
    return int((ours.view(torch.int32) != served.view(torch.int32)).sum()), float((ours - served).abs().max())


def test_triton_set_inside_sglang_is_exact(tmp_path: Path) -> None:
    sglang_env_python()
    ckpt = save_checkpoint(tmp_path / "ckpt", "float32", seed=3, cfg=MODEL)
    # float32: the interpreter's bf16 tl.dot is wrong (tests/kernels/test_kernels_triton.py).
    server = SGLangServer(tmp_path, "triton", ckpt, ["contract=qwen3_dense_triton_v1", "contract.dtype=float32"])
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, MODEL.vocab_size, (12,), generator=g).tolist()
    prompts = [shared[:9], shared, torch.randint(0, MODEL.vocab_size, (5,), generator=g).tolist()]
    try:
        client = server.start_healthy()
        first = _generate(server.url, prompts[0], 0)  # alone: its prompt is then in the radix cache
        with ThreadPoolExecutor(2) as pool:  # these two prefill and decode as one batch
            rest = list(pool.map(lambda i: _generate(server.url, prompts[i], i), (1, 2)))
        reported = client.contract()
    finally:
        server.stop()
    outs = [first, *rest]
    assert [len(o["output_ids"]) for o in outs] == [NEW_TOKENS] * 3
    assert outs[1]["meta_info"].get("cached_tokens", 0) > 0, "the radix cache served no prefix"
    assert reported["runtime"]["kernels"]["kernel_set"] == "triton", reported["runtime"]

    cfg, sd = load_hf(str(ckpt))
    triton_model = Qwen3(cfg, get_kernels("triton", attention_tile=64), torch.float32, sd)
    plain_model = Qwen3(cfg, get_kernels("plain"), torch.float32, sd)
    exact, plain, recipe = [], [], []
    for prompt, out in zip(prompts, outs, strict=True):
        served, response = _served(out), torch.tensor(out["output_ids"])
        logits = _logits(triton_model, prompt, out)
        exact.append(_mismatch(served, triton_model.kernels.logprobs(logits, response, cfg.vocab_size, TEMPERATURE)))
        # SGLang's own route: torch's log_softmax of the same logits (on every position's first 64 vocab
        # ids). It differs from the set's kernel, so the served values do not equal the kernel's by accident.
        ids = torch.arange(64).expand(len(response), -1)
        wide = logits[:, None].expand(-1, 64, -1)
        torch_route = pointwise.logprobs(wide, ids, cfg.vocab_size, TEMPERATURE)
        recipe.append(_mismatch(torch_route, triton_model.kernels.logprobs(wide, ids, cfg.vocab_size, TEMPERATURE)))
        plain_logits = _logits(plain_model, prompt, out)
        plain.append(
            _mismatch(served, plain_model.kernels.logprobs(plain_logits, response, cfg.vocab_size, TEMPERATURE))
        )
    print(f"triton set in SGLang vs full forward: exact {exact}, plain kernels {plain}, torch recipe {recipe}")
    assert all(m == 0 and d == 0.0 for m, d in exact), exact
    assert sum(m for m, _ in plain) > 0 and 0 < max(d for _, d in plain) < 1e-3, plain
    assert sum(m for m, _ in recipe) > 0 and max(d for _, d in recipe) < 1e-5, recipe
