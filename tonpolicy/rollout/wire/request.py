"""SGLang's native HTTP protocol, the request side: what `POST /generate` accepts.

Field names follow SGLang's own definitions (sgl-project/sglang, python/sglang/srt/):
- request body: `managers/io_struct.py::GenerateReqInput` (`input_ids` or `text`, one prompt or a
  batch, `sampling_params` dict or per-item list, `rid`, `return_logprob`, `logprob_start_len`
  (>= 0: prompt logprobs), `top_logprobs_num`, `return_text_in_logprobs`, `stream`);
- `sampling_params`: `sampling/sampling_params.py::SamplingParams` (`max_new_tokens`=128,
  `temperature`, `top_p`, `top_k` (-1 = whole vocabulary), `stop_token_ids`, `sampling_seed`,
  `ignore_eos`, `n`); temperature below 1e-6 means greedy, i.e. temperature 1 and top_k 1, as SGLang
  normalizes it; `n` samples per prompt are expanded prompt-major, each with a fresh rid, and the
  answer is then a list (`tokenizer_manager.py::_handle_batch_request`);
- `POST /update_weights_from_disk` body `UpdateWeightFromDiskReqInput` (`model_path`, `load_format`,
  `abort_all_requests`, `weight_version`, `flush_cache`), answer `{success, message, num_paused_requests}`.

Anything that would change the sampled bits and that the embedded engine does not implement
(penalties, min_p, grammars, text stops) is refused with a 400 rather than silently ignored.
The answer side (output items, stream chunks, what the trainer reads) is tonpolicy.rollout.wire.response.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

# SamplingParams.top_k's "whole vocabulary" sentinel (TOP_K_ALL = 1 << 30); -1 means the same.
TOP_K_ALL = 1 << 30
DEFAULT_MAX_NEW_TOKENS = 128
MAX_N = 1024  # samples per prompt; more is surely a mistake (and memory)
MAX_TOP_LOGPROBS = 1024
_GREEDY_EPS = 1e-6


class ProtocolError(ValueError):
    """A request the server refuses (HTTP 400 unless `status` says otherwise)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sampling:
    """Normalized sampling parameters of one request (engine-ready)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int  # -1: whole vocabulary
    stop_token_ids: tuple[int, ...]
    sampling_seed: int | None
    n: int = 1  # samples per prompt
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerateItem:
    """One sample of a /generate request (a prompt, or one of its n samples)."""

    rid: str | None
    input_ids: tuple[int, ...]
    sampling: Sampling
    return_logprob: bool
    logprob_start_len: int = -1  # >= 0: also the prompt's logprobs from this position
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # the first position whose routing is reported


@dataclass(frozen=True)
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool  # the answer is a list (a batch of prompts, or n > 1)
    stream: bool


# text -> token ids; raises ProtocolError when the server has no tokenizer.
Tokenize = Callable[[str], list[int]]


# SamplingParams fields that are accepted but do not change token ids or logprobs here
# (text rendering, streaming cadence, EOS handling: the embedded model has no tokenizer/EOS).
_SAMPLING_IGNORED = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
}
# SamplingParams fields the engine does not implement: only their neutral value is accepted.
_SAMPLING_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
_SAMPLING_USED = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed", "n", "ignore_eos",
}  # fmt: skip

# GenerateReqInput fields that do not affect generation (metrics, routing, logging).
_REQUEST_IGNORED = {
    "log_metrics",
    "custom_labels",
    "priority",
    "no_logs",
    "routing_key",
    "conversation_id",
    "session_id",
    "received_time",
    "external_trace_header",
    "return_text_in_logprobs",  # the text slot of logprob triples is filled when there is a tokenizer
    "model",  # sglang-router forwards its own request schema, whose `model` (the served model's name) is null
}
_REQUEST_NEUTRAL: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "lora_path": None,
    "session_params": None,
    "custom_logit_processor": None,
    # sglang-router's request schema sends these, at their neutral values, with every /generate
    "background": False,
    "return_bytes": False,
    "return_entropy": False,
}
_REQUEST_USED = {
    "input_ids", "text", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_routed_experts", "routed_experts_start_len",
    "stream",
}  # fmt: skip


def _neutral(value: Any, neutral: Any) -> bool:
    # Empty lists/strings count as "not set", like SGLang's own falsy checks.
    return value is None or value == neutral or (neutral is None and value in ("", [], {}))


def check_fields(d: dict[str, Any], used: set[str], ignored: set[str], neutral: dict[str, Any], what: str) -> None:
    for key, value in d.items():
        if key in used or key in ignored:
            continue
        if key in neutral:
            if not _neutral(value, neutral[key]):
                raise ProtocolError(f"{what} field {key!r}={value!r} is not supported by this server")
            continue
        raise ProtocolError(f"unknown {what} field {key!r}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {value!r}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_sampling_params(d: dict[str, Any] | None) -> Sampling:
    """SGLang SamplingParams (JSON dict) -> Sampling, with SGLang's defaults and normalization."""
    if d is not None and not isinstance(d, dict):
        raise ProtocolError("sampling_params must be an object (or, for a batch, a list of objects)")
    d = dict(d or {})
    check_fields(d, _SAMPLING_USED, _SAMPLING_IGNORED, _SAMPLING_NEUTRAL, "sampling_params")
    get = lambda k, default: default if d.get(k) is None else d[k]  # noqa: E731  (null = default)
    max_new_tokens = _int(get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "max_new_tokens")
    temperature = _float(get("temperature", 1.0), "temperature")
    top_p = _float(get("top_p", 1.0), "top_p")
    top_k = _int(get("top_k", -1), "top_k")
    if max_new_tokens < 0:
        raise ProtocolError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ProtocolError(f"temperature must be a non-negative finite number, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < _GREEDY_EPS:  # SGLang: greedy is temperature 1 with top_k 1
        temperature, top_k = 1.0, 1
    if top_k == -1 or top_k >= TOP_K_ALL:
        top_k = -1
    elif top_k < 1:
        raise ProtocolError(f"top_k must be -1 (disable) or at least 1, got {top_k}")
    stops = d.get("stop_token_ids") or []
    if not isinstance(stops, list):
        raise ProtocolError("stop_token_ids must be a list of integers")
    # SGLang stores them as a set; a sorted tuple keeps requests hashable and deterministic.
    stop_ids = tuple(sorted({_int(t, "stop_token_ids[]") for t in stops}))
    seed = d.get("sampling_seed")
    seed = None if seed is None else _int(seed, "sampling_seed")
    if seed is not None and not 0 <= seed < 2**63:
        # Checked at admission: a seed the generator refuses must not fail the batch it would join.
        raise ProtocolError(f"sampling_seed must be in [0, 2**63), got {seed}")
    n = _int(get("n", 1), "n")
    if not 1 <= n <= MAX_N:
        raise ProtocolError(f"n must be in [1, {MAX_N}], got {n}")
    ignore_eos = get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ProtocolError(f"ignore_eos must be a boolean, got {ignore_eos!r}")
    return Sampling(max_new_tokens, temperature, top_p, top_k, stop_ids, seed, n, ignore_eos)


def _prompts(body: dict[str, Any], tokenize: Tokenize | None) -> tuple[list[list[int]], bool]:
    """The request's prompts as token ids, and whether it was a batch."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise ProtocolError("give exactly one of input_ids and text")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a non-empty list of strings")
        if tokenize is None:
            raise ProtocolError(
                "this server has no tokenizer (its checkpoint has none, or it runs with "
                "--skip-tokenizer-init): send input_ids"
            )
        prompts = [tokenize(t) for t in texts]
        if not all(prompts):
            raise ProtocolError("a text prompt tokenizes to no tokens")
        return prompts, is_batch
    if not isinstance(ids, list) or not ids:
        raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    is_batch = isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    for p in prompts:
        if not isinstance(p, list) or not p:
            raise ProtocolError("every prompt in input_ids must be a non-empty list of token ids")
        for t in p:
            _int(t, "input_ids[]")
    return prompts, is_batch


def parse_generate_request(body: Any, tokenize: Tokenize | None = None) -> GenerateRequest:
    """GenerateReqInput JSON -> items (n per prompt, prompt-major, as SGLang expands them)."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    check_fields(body, _REQUEST_USED, _REQUEST_IGNORED, _REQUEST_NEUTRAL, "request")
    prompts, is_batch = _prompts(body, tokenize)
    count = len(prompts)

    def per_item(name: str, value: Any, is_list: bool) -> list[Any]:
        if is_batch and is_list:
            if len(value) != count:
                raise ProtocolError(f"{name} has {len(value)} entries for {count} prompts")
            return list(value)
        return [value] * count

    sp = body.get("sampling_params")
    sampling = [parse_sampling_params(s) for s in per_item("sampling_params", sp, isinstance(sp, list))]
    n = sampling[0].n
    if any(s.n != n for s in sampling):
        raise ProtocolError("sampling_params.n must be the same for every prompt of a batch")
    lp = body.get("return_logprob")
    lps = per_item("return_logprob", lp, isinstance(lp, list))
    start = body.get("logprob_start_len")
    starts = [_logprob_start(s) for s in per_item("logprob_start_len", start, isinstance(start, list))]
    top = body.get("top_logprobs_num")
    tops = [_top_logprobs_num(t) for t in per_item("top_logprobs_num", top, isinstance(top, list))]
    routed = body.get("return_routed_experts") or False
    if not isinstance(routed, bool):
        raise ProtocolError(f"return_routed_experts must be a boolean, got {routed!r}")
    routed_start = _int(body.get("routed_experts_start_len") or 0, "routed_experts_start_len")
    if routed_start < 0 or any(routed_start > len(p) for p in prompts):
        raise ProtocolError(f"routed_experts_start_len must be in [0, prompt tokens], got {routed_start}")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ProtocolError(f"stream must be a boolean, got {stream!r}")
    rid = body.get("rid")
    if n > 1:
        rids: list[str | None] = [None] * count  # SGLang gives every sample a fresh rid
    elif is_batch and isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(count)]  # SGLang: a string is a prefix
    else:
        rids = per_item("rid", rid, isinstance(rid, list))
    items = [
        GenerateItem(r, tuple(p), _nth_sample(s, j, n), bool(lg), st, tp, routed, routed_start)
        for r, p, s, lg, st, tp in zip(rids, prompts, sampling, lps, starts, tops, strict=True)
        for j in range(n)
    ]
    return GenerateRequest(items, is_batch or n > 1, stream)


def _nth_sample(s: Sampling, j: int, n: int) -> Sampling:
    # n samples of one seeded request differ (as in SGLang) and are reproducible: seeds seed+0..n-1.
    if n == 1 or s.sampling_seed is None:
        return s
    return replace(s, sampling_seed=(s.sampling_seed + j) % 2**63)


def _logprob_start(value: Any) -> int:
    start = -1 if value is None else _int(value, "logprob_start_len")
    if start < -1:
        raise ProtocolError(f"logprob_start_len must be -1 (no prompt logprobs) or at least 0, got {start}")
    return start


def _top_logprobs_num(value: Any) -> int:
    k = 0 if value is None else _int(value, "top_logprobs_num")
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ProtocolError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    return k
