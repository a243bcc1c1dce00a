"""SGLang's native HTTP protocol, the subset tonpolicy speaks on both sides of the wire.

Field names follow SGLang's own definitions (sgl-project/sglang, python/sglang/srt/):
- request body of `POST /generate`: `managers/io_struct.py::GenerateReqInput` (`input_ids` single
  list or batch of lists, `sampling_params` dict or per-item list, `rid`, `return_logprob`,
  `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`, `stream`);
- `sampling_params`: `sampling/sampling_params.py::SamplingParams` (`max_new_tokens`=128,
  `temperature`, `top_p`, `top_k` (-1 = whole vocabulary), `stop_token_ids`, `sampling_seed`, ...);
  temperature below 1e-6 means greedy, i.e. temperature 1 and top_k 1, as SGLang normalizes it;
- response: `{"output_ids", "meta_info"}` per item (the `skip_tokenizer_init` shape: no `text`),
  a list for a batch; `meta_info` = `managers/tokenizer_manager.py::_handle_batch_output`
  (`id`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`, `weight_version`)
  plus `output_token_logprobs` = `[[logprob, token_id, text_or_null], ...]`
  (`detokenize_logprob_tokens`); `finish_reason` = `schedule_batch.py::FINISH_LENGTH.to_json()`
  `{"type": "length", "length": n}` or `FINISH_MATCHED_TOKEN.to_json()` `{"type": "stop", "matched": id}`;
- `POST /update_weights_from_disk` body `UpdateWeightFromDiskReqInput` (`model_path`, `load_format`,
  `abort_all_requests`, `weight_version`, `flush_cache`), answer `{success, message, num_paused_requests}`.

Anything that would change the sampled bits and that the embedded engine does not implement
(penalties, min_p, grammars, text stops, n > 1, streaming) is refused with a 400 rather than
silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# SamplingParams.top_k's "whole vocabulary" sentinel (TOP_K_ALL = 1 << 30); -1 means the same.
TOP_K_ALL = 1 << 30
DEFAULT_MAX_NEW_TOKENS = 128
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


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a /generate request."""

    rid: str | None
    input_ids: tuple[int, ...]
    sampling: Sampling
    return_logprob: bool


# SamplingParams fields that are accepted but do not change token ids or logprobs here
# (text rendering, streaming cadence, EOS handling: the embedded model has no tokenizer/EOS).
_SAMPLING_IGNORED = {
    "ignore_eos",
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
    "n": 1,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
_SAMPLING_USED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed"}

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
    "return_text_in_logprobs",  # no tokenizer: the text slot is always null
}
_REQUEST_NEUTRAL: dict[str, Any] = {
    "text": None,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "stream": False,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "lora_path": None,
    "session_params": None,
    "custom_logit_processor": None,
}
_REQUEST_USED = {"input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len"}


def _neutral(value: Any, neutral: Any) -> bool:
    # Empty lists/strings count as "not set", like SGLang's own falsy checks.
    return value is None or value == neutral or (neutral is None and value in ("", [], {}))


def _check_fields(
    d: dict[str, Any], used: set[str], ignored: set[str], neutral: dict[str, Any], what: str
) -> None:
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
    _check_fields(d, _SAMPLING_USED, _SAMPLING_IGNORED, _SAMPLING_NEUTRAL, "sampling_params")
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
    return Sampling(max_new_tokens, temperature, top_p, top_k, stop_ids, seed)


def parse_generate_request(body: Any) -> tuple[list[GenerateItem], bool]:
    """GenerateReqInput JSON -> (items, is_batch). A batch answers with a list, in input order."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    _check_fields(body, _REQUEST_USED, _REQUEST_IGNORED, _REQUEST_NEUTRAL, "request")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ProtocolError("input_ids is required (this server has no tokenizer: text is not accepted)")
    is_batch = isinstance(ids[0], list)
    prompts = ids if is_batch else [ids]
    n = len(prompts)
    for p in prompts:
        if not isinstance(p, list) or not p:
            raise ProtocolError("every prompt in input_ids must be a non-empty list of token ids")
        for t in p:
            _int(t, "input_ids[]")

    def per_item(name: str, value: Any, is_list: bool) -> list[Any]:
        if is_batch and is_list:
            if len(value) != n:
                raise ProtocolError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    sp = body.get("sampling_params")
    sps = per_item("sampling_params", sp, isinstance(sp, list))
    lp = body.get("return_logprob")
    lps = per_item("return_logprob", lp, isinstance(lp, list))
    start = body.get("logprob_start_len")
    for s in per_item("logprob_start_len", start, isinstance(start, list)):
        if s not in (None, -1):
            raise ProtocolError("prompt logprobs (logprob_start_len >= 0) are not supported")
    rid = body.get("rid")
    if is_batch and isinstance(rid, str):
        rids: list[str | None] = [f"{rid}_{i}" for i in range(n)]  # SGLang: a string is a prefix
    else:
        rids = per_item("rid", rid, isinstance(rid, list))
    items = [
        GenerateItem(r, tuple(p), parse_sampling_params(s), bool(lg))
        for r, p, s, lg in zip(rids, prompts, sps, lps, strict=True)
    ]
    return items, is_batch


def finish_reason_json(kind: str, output_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Engine finish reason ("length" | "stop") -> SGLang's FINISH_* to_json() shape."""
    if kind == "stop":
        return {"type": "stop", "matched": output_ids[-1] if output_ids else None}
    if kind == "length":
        return {"type": "length", "length": max_new_tokens}
    raise ValueError(f"unknown finish reason {kind!r}")


def build_generate_output(
    rid: str,
    item: GenerateItem,
    output_ids: list[int],
    output_logprobs: list[float],
    finish_reason: dict[str, Any],
    weight_version: str,
) -> dict[str, Any]:
    """One /generate answer item. Logprobs are Python floats of fp32 values: JSON keeps them exact."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": len(item.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    if item.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(output_logprobs, output_ids, strict=True)
        ]
    return {"output_ids": output_ids, "meta_info": meta}


def parse_generate_output(out: dict[str, Any]) -> dict[str, Any]:
    """One /generate answer item (from this server or real SGLang) -> what the trainer uses."""
    meta = out["meta_info"]
    output_ids = [int(t) for t in out["output_ids"]]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ProtocolError("answer has no meta_info.output_token_logprobs (was return_logprob set?)")
    if [int(t[1]) for t in triples] != output_ids:
        raise ProtocolError("output_token_logprobs token ids do not match output_ids")
    finish = meta.get("finish_reason")
    return {
        "output_ids": output_ids,
        # SGLang serializes with orjson, which writes a non-finite float as null: keep it a NaN so
        # a parity check can never mistake it for a real value.
        "output_logprobs": [float("nan") if t[0] is None else float(t[0]) for t in triples],
        "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
        "weight_version": meta.get("weight_version"),
    }
