"""Both servers answer alike: one request stream (greedy, prompts of several lengths, concurrent, with
and without n, text and token ids, prompt and top logprobs) sent to tonpolicy's embedded server and to
released SGLang on the same checkpoint. With tonpolicy's contract model package SGLang gives the same
tokens, text and fp32 logprob bits as the embedded server; stock SGLang (its own model and kernels,
the negative control) gives the same tokens wherever the top-2 gap exceeds its numerical noise, and
logprobs that differ by a small non-zero amount. Contract v2: the embedded server runs under .venv's
torch build, released SGLang under its own (v2's bits depend on neither). Inside SGLang the package gives
the sampled tokens', the top and the prompt logprobs by v2's recipe. Needs the SGLang environment
(scripts/setup_sglang.sh)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from support.server_proc import ServerProc
from support.sglang_proc import SGLangServer

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.contract.identity import identity

DTYPE = "float32"
MAX_NEW = 12
VOCAB = ModelConfig().vocab_size  # the tiny checkpoint's
STOCK_NOISE = 1e-3  # stock SGLang's logprobs differ from the contract's by less (test_sglang_real)


def request_stream(vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    shared = [rng.randrange(10, vocab) for _ in range(150)]
    bodies: list[dict[str, Any]] = []
    for n, length in enumerate((1, 5, 33, 70, 150)):
        ids = shared[:length] if n % 2 else [rng.randrange(10, vocab) for _ in range(length)]
        bodies.append({"input_ids": ids, "logprob_start_len": 0 if length < 100 else 60, "top_logprobs_num": 2})
        bodies.append({"input_ids": ids, "sampling_params": {"n": 2}, "top_logprobs_num": 2})
    bodies.append(
        {
            "text": "copy 1 2 3 :",
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        }
    )
    bodies.append({"input_ids": [shared[:40], shared[:41]], "top_logprobs_num": 2})  # a batch
    for b in bodies:
        b["return_logprob"] = True
        b["sampling_params"] = {"max_new_tokens": MAX_NEW, "temperature": 0, **b.get("sampling_params", {})}
    return bodies * 2  # twice: SGLang's second round is served from its radix cache


def send_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every request at once (continuous batching); answers flattened to items, in request order."""

    def one(body: dict[str, Any]) -> list[dict[str, Any]]:
        req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            out = json.loads(urllib.request.urlopen(req, timeout=600).read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{url} refused {json.dumps(body)[:300]}: {e.read()[:500]!r}") from e
        return out if isinstance(out, list) else [out]

    with ThreadPoolExecutor(len(bodies)) as pool:
        return [item for items in pool.map(one, bodies) for item in items]


def bits(triples: list[list[Any]]) -> list[int | None]:
    return [None if lp is None else int(torch.tensor(lp, dtype=torch.float32).view(torch.int32)) for lp, *_ in triples]


def top_bits(tops: list[Any]) -> list[Any]:
    return [None if top is None else [(t, b) for (_, t, _), b in zip(top, bits(top), strict=True)] for top in tops]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, fp32_ckpt: Path) -> Iterator[list[dict[str, Any]]]:
    ident = identity(compose_config([f"contract={CONTRACT}", f"contract.dtype={DTYPE}"]).contract)
    args = ["--model-path", str(fp32_ckpt), "--dtype", DTYPE, "--kernels", "ordered", "--max-running-requests", "32",
            "--chunked-prefill-size", "64", "--contract-name", ident.name, "--contract-version", str(ident.version),
            "--contract-fingerprint", ident.fingerprint]  # fmt: skip
    srv = ServerProc(tmp_path_factory.mktemp("embedded"), "embedded", args)
    try:
        srv.start_healthy(timeout_s=120)
        yield send_all(f"http://127.0.0.1:{srv.port}", request_stream(VOCAB))
    finally:
        srv.stop()


CONTRACT = "qwen3_dense_v2"


def test_sglang_with_the_contract_answers_bit_for_bit_alike(
    contract_fp32_server: SGLangServer, embedded: list[dict[str, Any]]
) -> None:
    theirs = send_all(contract_fp32_server.url, request_stream(VOCAB))
    assert len(theirs) == len(embedded)
    tokens = 0
    for ours, real in zip(embedded, theirs, strict=True):
        mo, mr = ours["meta_info"], real["meta_info"]
        assert ours["output_ids"] == real["output_ids"] and ours["text"] == real["text"]
        assert mo["finish_reason"] == mr["finish_reason"] and mo["prompt_tokens"] == mr["prompt_tokens"]
        assert bits(mo["output_token_logprobs"]) == bits(mr["output_token_logprobs"])
        assert mo["output_token_logprobs"] == mr["output_token_logprobs"]  # token texts too
        assert bits(mo["input_token_logprobs"]) == bits(mr["input_token_logprobs"])
        assert top_bits(mo["output_top_logprobs"]) == top_bits(mr["output_top_logprobs"])
        assert top_bits(mo["input_top_logprobs"]) == top_bits(mr["input_top_logprobs"])
        tokens += len(ours["output_ids"])
    assert tokens > 0.9 * len(embedded) * MAX_NEW  # the stream was not cut short by early stops


def test_stock_sglang_agrees_where_the_gaps_allow(
    stock_fp32_server: SGLangServer, embedded: list[dict[str, Any]]
) -> None:
    """Negative control: stock SGLang's logprobs differ a little; its greedy tokens differ only
    where the two most likely tokens are closer than that noise."""
    theirs = send_all(stock_fp32_server.url, request_stream(VOCAB))
    compared = diverged = 0
    worst = 0.0
    for ours, real in zip(embedded, theirs, strict=True):
        mo, mr = ours["meta_info"], real["meta_info"]
        for i, (a, b) in enumerate(zip(ours["output_ids"], real["output_ids"], strict=False)):
            if a != b:  # a tie within the noise: the rest of the sequence is another continuation
                (lp1, *_), (lp2, *_) = mo["output_top_logprobs"][i]
                assert lp1 - lp2 < STOCK_NOISE, (
                    i,
                    mo["output_top_logprobs"][i],
                    mr["output_top_logprobs"][i],
                )
                diverged += 1
                break
            worst = max(worst, abs(mo["output_token_logprobs"][i][0] - mr["output_token_logprobs"][i][0]))
            compared += 1
    print(f"stock SGLang: {compared} tokens compared, {diverged} of {len(embedded)} sequences diverged "
          f"at a near-tie, max |logprob diff| {worst:.3g}")  # fmt: skip
    assert compared > 0.5 * len(embedded) * MAX_NEW and 0 < worst < STOCK_NOISE
