"""The embedded server as SGLang's and OpenAI's clients see it: text in and out (the checkpoint's
tokenizer), n samples per prompt, streams, prompt and top logprobs, /v1/models, /v1/completions and
/v1/chat/completions. Every logprob is checked bit for bit against tonpolicy's own scoring."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.server_proc import DTYPE, IDENTITY, ServerProc, save_checkpoint
from support.text_api import call, with_chat_template

from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf
from tonpolicy.model.qwen3 import Qwen3
from tonpolicy.model.tokenizer import load_text_tokenizer
from tonpolicy.rollout.engine.logits import score_logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(save_checkpoint(tmp_path_factory.mktemp("ckpt") / "a", seed=3))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[str]:
    args = ["--model-path", str(ckpt), "--dtype", DTYPE, "--num-threads", "1", *IDENTITY]
    srv = ServerProc(tmp_path_factory.mktemp("server"), "text", args)
    srv.start_healthy()
    yield f"http://127.0.0.1:{srv.port}"
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def model(ckpt: Path) -> Qwen3:
    cfg, sd = load_hf(ckpt)
    return Qwen3(cfg, get_kernels("ordered"), getattr(torch, DTYPE), sd)


def bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def test_text_in_text_out_with_the_checkpoints_tokenizer(url: str, ckpt: Path, model: Qwen3) -> None:
    tok = load_text_tokenizer(ckpt)
    body = {"text": "copy 1 2 3 :", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}  # fmt: skip
    status, out = call(url, "/generate", body)
    assert status == 200, out
    prompt = tok.encode("copy 1 2 3 :")
    meta = out["meta_info"]
    # SGLang detokenizes after the prompt's last tokens: with a word-level tokenizer, a leading space
    assert meta["prompt_tokens"] == len(prompt) and out["text"] == " " + tok.decode(out["output_ids"])
    # prompt logprobs: SGLang's triples from position 0 (nothing predicts it: null), each equal to scoring
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == prompt and inputs[0][0] is None
    assert torch.equal(
        bits([lp for lp, _, _ in inputs[1:]]),
        bits(score_logprobs(model, prompt[:1], prompt[1:], 1.0).tolist()),
    )
    outputs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert torch.equal(bits(outputs), bits(score_logprobs(model, prompt, out["output_ids"], 1.0).tolist()))
    # greedy: the sampled token heads each top-k list, with the same logprob bits
    for (lp, t, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert len(top) == 3 and top[0][1] == t and bits([top[0][0]]).item() == bits([lp]).item()
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(prompt)


def test_stream_sends_cumulative_chunks_ending_in_the_plain_answer(url: str) -> None:
    body = {"input_ids": [3, 11, 12], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 5, "ignore_eos": True},
            "return_logprob": True}  # fmt: skip
    _, plain = call(url, "/generate", body)
    status, chunks = call(url, "/generate", {**body, "stream": True})
    assert status == 200 and len(chunks) == 6
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 7))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_n_samples_per_prompt(url: str) -> None:
    body = {
        "input_ids": [[3, 11], [3, 12, 13]],
        "sampling_params": {"max_new_tokens": 4, "n": 3, "ignore_eos": True},
    }
    status, outs = call(url, "/generate", body)
    assert status == 200 and len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 2, 2, 3, 3, 3]  # prompt-major
    assert len({o["meta_info"]["id"] for o in outs}) == 6
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1, "n samples of one prompt should differ"
    status, one = call(url, "/generate", {"input_ids": [3, 11], "sampling_params": {"n": 2, "max_new_tokens": 2}})
    assert status == 200 and isinstance(one, list) and len(one) == 2


def test_openai_models_and_completions(url: str, ckpt: Path) -> None:
    status, models = call(url, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == str(ckpt)
    body = {
        "model": str(ckpt),
        "prompt": "copy 4 5",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "ignore_eos": True,
    }
    status, out = call(url, "/v1/completions", body)
    assert status == 200 and out["object"] == "text_completion"
    choice = out["choices"][0]
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    _, native = call(url, "/generate", {"text": "copy 4 5", "sampling_params": sampling, "return_logprob": True})
    assert choice["text"] == native["text"] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "reasoning_tokens": 0,
    }
    # token-id prompts, n, and a stream whose text deltas add up to the whole
    status, out = call(url, "/v1/completions", {"model": "m", "prompt": [[3, 11], [3, 12]], "max_tokens": 3, "n": 2})
    assert status == 200 and len(out["choices"]) == 4 and out["usage"]["prompt_tokens"] == 4
    status, chunks = call(url, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and "".join(c["choices"][0]["text"] for c in chunks[:-1]) == choice["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_openai_chat_uses_the_chat_template(url: str, ckpt: Path) -> None:
    messages = [{"role": "user", "content": "copy 1 2"}]
    body = {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    status, out = call(url, "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion", out
    prompt = load_text_tokenizer(ckpt).apply_chat_template(messages)
    assert prompt == "user : copy 1 2 say"
    _, native = call(
        url,
        "/generate",
        {"text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}},
    )
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": native["text"]}
    assert len(out["choices"][0]["logprobs"]["content"]) == 3
    status, chunks = call(url, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == native["text"]


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/completions", {"model": "m", "prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stop": ["\n"]}, "stop"),
        ("/v1/completions", {"model": "m"}, "prompt is required"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/generate", {"text": "x", "input_ids": [1]}, "exactly one"),
        ("/generate", {"input_ids": [1], "sampling_params": {"n": 0}}, "n must be"),
    ],
)
def test_what_cannot_be_honoured_is_a_clear_400(url: str, path: str, body: dict, says: str) -> None:
    status, out = call(url, path, body)
    assert status == 400 and says in out["error"]["message"], out


def test_a_server_without_tokenizer_refuses_text_clearly(tmp_path: Path, ckpt: Path) -> None:
    args = [
        "--model-path",
        str(ckpt),
        "--dtype",
        DTYPE,
        "--num-threads",
        "1",
        "--skip-tokenizer-init",
        *IDENTITY,
    ]
    srv = ServerProc(tmp_path, "ids", args)
    try:
        srv.start_healthy()
        base = f"http://127.0.0.1:{srv.port}"
        status, out = call(base, "/generate", {"text": "copy 1"})
        assert status == 400 and "no tokenizer" in out["error"]["message"]
        status, out = call(base, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and "chat template" in out["error"]["message"]
        status, out = call(base, "/generate", {"input_ids": [3, 11], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and "text" not in out  # SGLang's --skip-tokenizer-init shape
    finally:
        srv.stop()
