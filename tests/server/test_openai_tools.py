"""`/v1/chat/completions` with `tools`, as an agent written against the OpenAI client drives it: the tools
reach the checkpoint's chat template, tool-call and tool messages in the history render, a reply's
`<tool_call>` blocks come back as OpenAI `tool_calls` (SGLang's qwen25 format), and `return_token_ids`
gives the prompt's and the reply's token ids with the logprobs of exactly those ids, bit for bit those
of /generate on the same ids (token in, token out)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.server_proc import DTYPE, IDENTITY, ServerProc, save_checkpoint

from tonpolicy.model.tokenizer import load_text_tokenizer
from tonpolicy.rollout.server.openai_routes import _chat_choice
from tonpolicy.rollout.server.tool_calls import check_tools, parse_tool_calls

TEMPLATE = (
    "{% for t in tools or [] %}tool {{ t['function']['name'] }} {% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}= {{ m['content'] }} "
    "{% elif m['tool_calls'] is defined %}call {{ m['tool_calls'][0]['function']['name'] }} "
    "{% else %}{{ m['role'] }} : {{ m['content'] }} {% endif %}{% endfor %}say{% if twice %} say{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_tool_call_blocks_are_read_as_openai_tool_calls() -> None:
    text = 'let me add <tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    content, calls = parse_tool_calls(text, TOOLS, "r")
    assert content == "let me add"
    assert calls == [
        {"id": "call_r_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    ]
    # not JSON, or a tool that was not offered: plain text
    assert parse_tool_calls("<tool_call>add 3 4</tool_call>", TOOLS, "r") == ("<tool_call>add 3 4</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"name": "rm"}</tool_call>', TOOLS, "r")[1] == []
    with pytest.raises(ValueError, match="constrained decoding"):
        check_tools({"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(ValueError, match="list of"):
        check_tools({"tools": [{"name": "add"}]})

    out = {"text": text, "output_ids": [5, 6, 7], "meta_info": {"id": "x", "finish_reason": {"type": "stop"}}}
    choice = _chat_choice(None, 0, out, TOOLS, {"return_token_ids": True}, (1, 2))  # type: ignore[arg-type]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert choice["prompt_token_ids"] == [1, 2] and choice["response_token_ids"] == [5, 6, 7]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    ck = save_checkpoint(tmp_path_factory.mktemp("ckpt") / "a", seed=4)
    config = json.loads((ck / "tokenizer_config.json").read_text())
    (ck / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    srv = ServerProc(tmp_path_factory.mktemp("srv"), "tools",
                     ["--model-path", str(ck), "--dtype", DTYPE, "--num-threads", "1", *IDENTITY])  # fmt: skip
    srv.start_healthy()
    yield f"http://127.0.0.1:{srv.port}", ck
    assert srv.stop() == 0, srv.log()


def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_with_tools_returns_the_sampled_ids_and_their_logprobs(served: tuple[str, Path]) -> None:
    url, ck = served
    messages = [
        {"role": "user", "content": "add 3 4"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "7"},
    ]  # fmt: skip
    body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 5, "seed": 11, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True}  # fmt: skip
    status, out = post(url, "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    tok = load_text_tokenizer(ck)
    prompt = tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages], TOOLS)
    assert prompt == "tool add user : add 3 4 call add = 7 say"  # the tools and the tool turn reached the template
    assert choice["prompt_token_ids"] == tok.encode(prompt)
    # the same ids through /generate: the same sample, the same logprob bits
    status, native = post(url, "/generate", {"input_ids": choice["prompt_token_ids"], "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 5, "sampling_seed": 11, "ignore_eos": True}})  # fmt: skip
    assert status == 200 and native["output_ids"] == choice["response_token_ids"]
    served_bits = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]]).view(torch.int32)
    native_bits = torch.tensor([t[0] for t in native["meta_info"]["output_token_logprobs"]]).view(torch.int32)
    assert torch.equal(served_bits, native_bits)
    # a forced call or a stream with token ids cannot be honoured: a clear 400
    for extra, says in [({"tool_choice": "required"}, "constrained"), ({"stream": True}, "stream")]:
        status, err = post(url, "/v1/chat/completions", {**body, **extra})
        assert status == 400 and says in err["error"]["message"], err


def test_chat_template_kwargs_reach_the_template(served: tuple[str, Path]) -> None:
    url, ck = served
    body = {"messages": [{"role": "user", "content": "add 3 4"}], "max_tokens": 1, "return_token_ids": True}
    status, plain = post(url, "/v1/chat/completions", body)
    status_kw, twice = post(url, "/v1/chat/completions", {**body, "chat_template_kwargs": {"twice": True}})
    assert status == status_kw == 200, (plain, twice)
    tok = load_text_tokenizer(ck)
    assert twice["choices"][0]["prompt_token_ids"] == tok.encode("user : add 3 4 say say")
    assert plain["choices"][0]["prompt_token_ids"] == tok.encode("user : add 3 4 say")
    status, err = post(url, "/v1/chat/completions", {**body, "chat_template_kwargs": ["twice"]})
    assert status == 400 and "chat_template_kwargs must be an object" in err["error"]["message"], err
