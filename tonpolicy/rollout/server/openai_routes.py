"""OpenAI-compatible endpoints on the embedded engine, built as SGLang builds them
(sglang/srt/entrypoints/openai/serving_completions.py, serving_chat.py): an OpenAI request becomes a
native /generate request (so it is checked and run the one way), and the native answers become
OpenAI's shapes. `/v1/completions` takes a text, token ids, or lists of either; `logprobs: k` gives
each token's logprob and the k most likely (`text_offset` is -1: SGLang does not track it either).
`/v1/chat/completions` needs a chat template in the checkpoint's tokenizer; it takes `tools` (given to the
template as `tools`, calls read back from the reply as SGLang's qwen25 parser does: `tool_calls.py`),
tool-call and `tool` messages in the history, and `return_token_ids` / `return_prompt_token_ids`
(SGLang's: each choice's `response_token_ids` and `prompt_token_ids`, so an agent driven through the
OpenAI client still hands a trainer the ids the engine sampled, with their logprobs). Streams are server-sent
events ending in `data: [DONE]`. What the engine cannot honour (echo, text stops, penalties, ...)
is refused with a 400, as on /generate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from tonpolicy.rollout.engine.generation import GenResult
from tonpolicy.rollout.server.state import (
    Response,
    ServerState,
    Stream,
    not_ready,
    progress_events,
    run_items,
)
from tonpolicy.rollout.server.tool_calls import check_tools, parse_tool_calls
from tonpolicy.rollout.wire.request import GenerateRequest, ProtocolError, check_fields, parse_generate_request
from tonpolicy.rollout.wire.response import STREAM_END, build_generate_output, stream_chunk

# Request fields mapped onto sampling_params (OpenAI name -> SGLang name).
_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "n": "n", "seed": "sampling_seed",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
}  # fmt: skip
_IGNORED = {"user", "skip_special_tokens", "no_stop_trim", "stream_options", "model"}
# Fields the engine does not implement: only their neutral value is accepted.
_NEUTRAL: dict[str, Any] = {
    "echo": False, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "logit_bias": None, "stop": None, "suffix": None, "min_p": 0.0, "min_tokens": 0, "best_of": None,
    "response_format": None, "json_schema": None, "regex": None, "ebnf": None, "return_hidden_states": False,
}  # fmt: skip
_COMPLETION_NEUTRAL = {**_NEUTRAL, "tools": None, "tool_choice": None, "parallel_tool_calls": None}
_COMPLETION_USED = {"prompt", "max_tokens", "stream", "logprobs", *_SAMPLING}
_CHAT_USED = {
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "return_token_ids",
    "return_prompt_token_ids",
    "chat_template_kwargs",
    *_SAMPLING,
}


def route_models(state: ServerState, body: Any) -> Response:
    cfg = state.model_config
    return 200, {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "tonpolicy",
                "root": state.model_name,
                "max_model_len": cfg.max_position_embeddings if cfg else None,
            }
        ],
    }


def _native_body(body: dict[str, Any], prompt: Any, max_tokens: Any, top_logprobs: int | None) -> dict[str, Any]:
    """The /generate request an OpenAI request stands for (SGLang's _convert_to_internal_request)."""
    sampling = {sg: body[oa] for oa, sg in _SAMPLING.items() if body.get(oa) is not None}
    sampling["max_new_tokens"] = 16 if max_tokens is None else max_tokens  # OpenAI's default
    is_text = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str))
    return {
        ("text" if is_text else "input_ids"): prompt,
        "sampling_params": sampling,
        "return_logprob": top_logprobs is not None,
        "top_logprobs_num": top_logprobs or 0,
        "return_text_in_logprobs": True,
        "stream": bool(body.get("stream")),
    }


def _parse(state: ServerState, native: dict[str, Any]) -> GenerateRequest:
    return parse_generate_request(native, state.tokenize if state.tokenizer is not None else None)


def route_completions(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return not_ready()
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    check_fields(body, _COMPLETION_USED, _IGNORED, _COMPLETION_NEUTRAL, "completion request")
    if "prompt" not in body:
        raise ProtocolError("prompt is required")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ProtocolError(f"logprobs must be a non-negative integer, got {logprobs!r}")
    req = _parse(state, _native_body(body, body["prompt"], body.get("max_tokens"), logprobs))
    return _answer(state, body, req, "text_completion", _completion_choice, _completion_delta)


def route_chat_completions(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return not_ready()
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    check_fields(body, _CHAT_USED, _IGNORED, _NEUTRAL, "chat completion request")
    tok = state.tokenizer
    if tok is None or tok.chat_template is None:
        raise ProtocolError("this model's tokenizer has no chat template: use /v1/completions or /generate")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(map(_is_message, messages)):
        raise ProtocolError(
            "messages must be a non-empty list of {role, content} objects with string content "
            "(an assistant message with tool_calls may have null content)"
        )
    try:
        tools = check_tools(body)
    except ValueError as e:
        raise ProtocolError(str(e)) from e
    ids = bool(body.get("return_token_ids")) or bool(body.get("return_prompt_token_ids"))
    if ids and body.get("stream"):
        raise ProtocolError("return_token_ids / return_prompt_token_ids with stream=true: set stream=false")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise ProtocolError('chat_template_kwargs must be an object (e.g. {"enable_thinking": false})')
    try:
        contents = [{**m, "content": m.get("content") or ""} for m in messages]
        prompt = tok.apply_chat_template(contents, tools, **template_kwargs)
    except Exception as e:  # noqa: BLE001 - a template that fails on these messages is the client's 400
        raise ProtocolError(f"the chat template failed on these messages: {e}") from e
    top = body.get("top_logprobs") if body.get("logprobs") else None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    req = _parse(state, _native_body(body, prompt, max_tokens, (top or 0) if body.get("logprobs") else None))
    parse = tools if tools and body.get("tool_choice") != "none" else None

    def choice(state: ServerState, i: int, out: dict[str, Any]) -> dict[str, Any]:
        return _chat_choice(state, i, out, parse, body, req.items[i].input_ids)

    return _answer(state, body, req, "chat.completion", choice, _chat_delta)


def _is_message(m: Any) -> bool:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    if m["role"] == "assistant" and m.get("tool_calls"):
        return isinstance(m["tool_calls"], list) and (m.get("content") is None or isinstance(m["content"], str))
    return isinstance(m.get("content"), str)


# --- answers ------------------------------------------------------------------------------------

Choice = Callable[[ServerState, int, dict[str, Any]], dict[str, Any]]
Delta = Callable[[ServerState, int, dict[str, Any], dict[str, Any] | None], dict[str, Any]]


def _answer(
    state: ServerState, body: dict[str, Any], req: GenerateRequest, kind: str, choice: Choice, delta: Delta
) -> Response:
    sub = run_items(state, req.items, stream=req.stream)
    created = int(time.time())
    head = {
        "id": sub.rids[0],
        "object": kind,
        "created": created,
        "model": body.get("model") or state.model_name,
    }
    decode = state.decode if state.tokenizer is not None else None

    def native(i: int, result: GenResult) -> dict[str, Any]:
        return build_generate_output(sub.rids[i], req.items[i], result, state.weight_version, decode, True)

    if req.stream:
        return 200, Stream(_stream(state, body, req, head, native, delta, sub))
    outs = [native(i, r) for i, r in enumerate(sub.future.result().results)]
    n = req.items[0].sampling.n
    return 200, {
        **head,
        "choices": [choice(state, i, o) for i, o in enumerate(outs)],
        "usage": _usage(outs, n),
    }


def _stream(
    state: ServerState,
    body: dict[str, Any],
    req: GenerateRequest,
    head: dict[str, Any],
    native: Callable[[int, GenResult], dict[str, Any]],
    delta: Delta,
    sub: Any,
) -> Iterator[bytes]:
    chunk_head = {
        **head,
        "object": head["object"] + (".chunk" if head["object"] == "chat.completion" else ""),
    }
    sent: dict[int, dict[str, Any]] = {}  # the last native state streamed, per choice
    finals: list[dict[str, Any] | None] = [None] * len(req.items)
    try:
        for i, result in progress_events(sub):
            out = native(i, result)
            choice = delta(state, i, out, sent.get(i))
            sent[i] = out
            if result.finish_reason:
                finals[i] = out
            yield stream_chunk({**chunk_head, "choices": [choice], "usage": None})
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            yield stream_chunk({**chunk_head, "choices": [], "usage": _usage(finals, req.items[0].sampling.n)})
    except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
        yield stream_chunk({"error": {"message": str(e), "type": "invalid_request_error", "code": 400}})
    yield STREAM_END


def _usage(outs: list[dict[str, Any] | None], n: int) -> dict[str, int]:
    metas = [o["meta_info"] for o in outs if o is not None]
    prompt = sum(m["prompt_tokens"] for m in metas[::n])  # each prompt once, however many samples
    completion = sum(m["completion_tokens"] for m in metas)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "reasoning_tokens": 0}  # fmt: skip


def _finish(meta: dict[str, Any]) -> dict[str, Any]:
    reason = meta["finish_reason"]
    return {
        "finish_reason": reason["type"] if reason else None,
        "matched_stop": reason.get("matched") if reason else None,
    }


def _completion_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any] | None:
    """OpenAI's legacy logprobs object (SGLang's to_openai_style_logprobs) for output tokens [start:]."""
    if "output_token_logprobs" not in meta:
        return None
    triples = meta["output_token_logprobs"][start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    return {
        "text_offset": [-1] * len(triples),
        "token_logprobs": [lp for lp, _, _ in triples],
        "tokens": [text for _, _, text in triples],
        "top_logprobs": [None if top is None else {text: lp for lp, _, text in top} for top in tops],
    }


def _completion_choice(state: ServerState, i: int, out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    return {"index": i, "text": out.get("text", ""), "logprobs": _completion_logprobs(meta), **_finish(meta)}


def _completion_delta(state: ServerState, i: int, out: dict[str, Any], last: dict[str, Any] | None) -> dict[str, Any]:
    done = len(last["output_ids"]) if last else 0
    text = out.get("text", "")[len(last.get("text", "")) if last else 0 :]
    return {
        "index": i,
        "text": text,
        "logprobs": _completion_logprobs(out["meta_info"], done),
        **_finish(out["meta_info"]),
    }


def _chat_logprobs(meta: dict[str, Any], start: int = 0) -> dict[str, Any] | None:
    if "output_token_logprobs" not in meta:
        return None
    tops = meta.get("output_top_logprobs") or [None] * len(meta["output_token_logprobs"])

    def entry(lp: float, text: str) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp, text), "top_logprobs": [entry(tlp, ttext) for tlp, _, ttext in (top or [])]}
        for (lp, _, text), top in zip(meta["output_token_logprobs"][start:], tops[start:], strict=True)
    ]}  # fmt: skip


def _chat_choice(
    state: ServerState,
    i: int,
    out: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    prompt_ids: tuple[int, ...] = (),
) -> dict[str, Any]:
    meta, body = out["meta_info"], body or {}
    message: dict[str, Any] = {"role": "assistant", "content": out.get("text", "")}
    finish = _finish(meta)
    if tools:
        content, calls = parse_tool_calls(message["content"], tools, f"{meta['id']}_{i}")
        if body.get("parallel_tool_calls") is False:
            calls = calls[:1]
        if calls:  # OpenAI's shape: the calls, their finish reason; the ids below stay what was sampled
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish["finish_reason"] = "tool_calls"
    answer = {"index": i, "message": message, "logprobs": _chat_logprobs(meta), **finish}
    if body.get("return_token_ids") or body.get("return_prompt_token_ids"):
        answer["prompt_token_ids"] = list(prompt_ids)
    if body.get("return_token_ids"):
        answer["response_token_ids"] = list(out["output_ids"])
    return answer


def _chat_delta(state: ServerState, i: int, out: dict[str, Any], last: dict[str, Any] | None) -> dict[str, Any]:
    done = len(last["output_ids"]) if last else 0
    delta: dict[str, Any] = {"content": out.get("text", "")[len(last.get("text", "")) if last else 0 :]}
    if last is None:
        delta["role"] = "assistant"
    return {
        "index": i,
        "delta": delta,
        "logprobs": _chat_logprobs(out["meta_info"], done),
        **_finish(out["meta_info"]),
    }


OPENAI_ROUTES = {
    ("GET", "/v1/models"): route_models,
    ("POST", "/v1/completions"): route_completions,
    ("POST", "/v1/chat/completions"): route_chat_completions,
}
