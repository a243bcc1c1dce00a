"""The answer side of SGLang's `/generate`: output items, stream chunks, and what the trainer reads.

Shapes follow SGLang (sgl-project/sglang, python/sglang/srt/managers/tokenizer_manager.py):
an item is `{"text", "output_ids", "meta_info"}` (no `text` when the server has no tokenizer, as with
SGLang's `--skip-tokenizer-init`); `meta_info` has `id`, `finish_reason`, `prompt_tokens`,
`completion_tokens`, `cached_tokens`, `weight_version`, and with `return_logprob`
`input_token_logprobs` / `output_token_logprobs` as `[logprob, token_id, text_or_null]` triples
(`detokenize_logprob_tokens`; the first prompt token's logprob is null), plus
`input_top_logprobs` / `output_top_logprobs` (a list of such triples per position, null where there
is none) when `top_logprobs_num` > 0. `finish_reason` is `FINISH_LENGTH.to_json()`
`{"type": "length", "length": n}` or `FINISH_MATCHED_TOKEN.to_json()` `{"type": "stop", "matched": id}`,
null while a stream runs. A stream sends each item's cumulative state as `data: {json}\n\n`
(with `index` in a batch), then `data: [DONE]\n\n`.
Logprobs are Python floats of fp32 values: JSON keeps them exact.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tonpolicy.rollout.wire.request import GenerateItem, ProtocolError

if TYPE_CHECKING:  # the engine's result type, for the server's side only: the client loads no engine
    from tonpolicy.rollout.engine.generation import GenResult, TopLogprobs

# token ids -> text; None when the server has no tokenizer
Decode = Callable[[list[int]], str] | None


def finish_reason_json(kind: str, output_ids: list[int], max_new_tokens: int) -> dict[str, Any] | None:
    """Engine finish reason ("length" | "stop" | "" while running) -> SGLang's FINISH_* to_json()."""
    if kind == "":
        return None
    if kind == "stop":
        return {"type": "stop", "matched": output_ids[-1] if output_ids else None}
    if kind == "length":
        return {"type": "length", "length": max_new_tokens}
    raise ValueError(f"unknown finish reason {kind!r}")


def _triples(pairs: list[tuple[float | None, int]], decode: Decode, with_text: bool) -> list[list[Any]]:
    text = (lambda t: decode([t])) if decode is not None and with_text else (lambda t: None)  # noqa: E731
    return [[lp, t, text(t)] for lp, t in pairs]


def _tops(tops: list[TopLogprobs | None], decode: Decode, with_text: bool) -> list[list[list[Any]] | None]:
    return [None if top is None else _triples(top, decode, with_text) for top in tops]


def build_generate_output(
    rid: str,
    item: GenerateItem,
    result: GenResult,
    weight_version: str,
    decode: Decode = None,
    return_text_in_logprobs: bool = False,
) -> dict[str, Any]:
    """One /generate answer item (or the cumulative state of a streamed one)."""
    ids = list(result.output_ids)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason_json(result.finish_reason, ids, item.sampling.max_new_tokens),
        "prompt_tokens": len(item.input_ids),
        "completion_tokens": len(ids),
        "cached_tokens": result.cached_tokens,
        "weight_version": weight_version,
        # SGLang's per-token versions: spans of output positions [start, end) and the weight version
        # that sampled them. The engine loads weights only between requests, so a request has one span.
        "weight_versions": [{"version": weight_version, "start": 0, "end": len(ids)}],
    }
    if item.return_logprob:
        lps = result.output_logprobs.float().tolist()  # exact fp32 values as Python floats
        prompt = item.input_ids
        positions = range(item.logprob_start_len, len(prompt)) if item.logprob_start_len >= 0 else range(0)
        meta["input_token_logprobs"] = _triples(
            [(result.prompt_logprobs.get(p), prompt[p]) for p in positions], decode, return_text_in_logprobs
        )
        meta["output_token_logprobs"] = _triples(list(zip(lps, ids, strict=True)), decode, return_text_in_logprobs)
        if item.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _tops(
                [result.prompt_top_logprobs.get(p) for p in positions], decode, return_text_in_logprobs
            )
            meta["output_top_logprobs"] = _tops(result.output_top_logprobs, decode, return_text_in_logprobs)
    if item.return_routed_experts and result.routed_experts is not None:
        # SGLang's encoding: base64 of the int32 [positions, layers, top_k] array from the start position.
        table = result.routed_experts[item.routed_experts_start_len :].contiguous()
        meta["routed_experts"] = base64.b64encode(table.numpy().tobytes()).decode("ascii")
    out: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    if decode is not None:
        out = {"text": output_text(decode, item.input_ids, ids), **out}
    return out


# SGLang's detokenizer decodes the output after up to this many prompt tokens and keeps what they add
# (INIT_INCREMENTAL_DETOKENIZATION_OFFSET): a word-level tokenizer's output text so starts with a space.
_DETOKENIZE_CONTEXT = 5


def output_text(decode: Callable[[list[int]], str], prompt: tuple[int, ...], ids: list[int]) -> str:
    context = list(prompt[-_DETOKENIZE_CONTEXT:])
    return decode(context + ids)[len(decode(context)) :]


def stream_chunk(out: dict[str, Any], index: int | None = None) -> bytes:
    """One server-sent event of a streamed /generate (`index` names the item of a batch)."""
    import json

    body = out if index is None else {**out, "index": index}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


STREAM_END = b"data: [DONE]\n\n"


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
        "weight_versions": token_weight_versions(meta, len(output_ids)),
        "routed_experts": meta.get("routed_experts"),  # base64 int32 [positions, layers, top_k], if asked
        "cached_tokens": int(meta.get("cached_tokens") or 0),  # prompt tokens served from the prefix cache
    }


def token_weight_versions(meta: dict[str, Any], n: int) -> list[str | None]:
    """The weight version that sampled each output token, from SGLang's `meta_info.weight_versions`
    spans ({version, start, end} over output positions); a server that sends no spans (an older
    SGLang) sampled the request under its one `weight_version`."""
    spans = meta.get("weight_versions")
    if not spans:
        return [meta.get("weight_version")] * n
    versions: list[str | None] = [None] * n
    for span in spans:
        for i in range(int(span["start"]), min(int(span["end"]), n)):
            versions[i] = span["version"]
    if None in versions:
        raise ProtocolError(f"meta_info.weight_versions {spans} do not cover the {n} output tokens")
    return versions


def decode_routed_experts(b64: str, num_layers: int, top_k: int) -> list[list[list[int]]]:
    """meta_info.routed_experts (SGLang's base64 of int32 [positions, layers, top_k]) -> nested lists."""
    import array

    flat = array.array("i")
    flat.frombytes(base64.b64decode(b64))
    per = num_layers * top_k
    if per == 0 or len(flat) % per:
        raise ProtocolError(f"routed_experts has {len(flat)} ids, not a multiple of layers*top_k={per}")
    rows = [flat[i : i + per].tolist() for i in range(0, len(flat), per)]
    return [[row[j : j + top_k] for j in range(0, per, top_k)] for row in rows]
