"""SGLang protocol mapping: request parsing, SGLang's defaults and normalization, answer shapes."""

from __future__ import annotations

import json

import pytest
import torch

from tonpolicy.rollout.engine.generation import GenResult
from tonpolicy.rollout.wire.request import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerateItem,
    ProtocolError,
    Sampling,
    parse_generate_request,
    parse_sampling_params,
)
from tonpolicy.rollout.wire.response import build_generate_output, finish_reason_json, parse_generate_output


def _result(ids: list[int], lps: list[float], reason: str = "length") -> GenResult:
    return GenResult(ids, torch.tensor(lps, dtype=torch.float32), reason)


def test_sampling_defaults_are_sglangs() -> None:
    s = parse_sampling_params(None)
    assert s == Sampling(DEFAULT_MAX_NEW_TOKENS, 1.0, 1.0, -1, (), None)
    # null means "default", as SamplingParams.__post_init__ treats it
    assert parse_sampling_params({"temperature": None, "top_k": None}) == s


def test_greedy_and_top_k_normalization() -> None:
    g = parse_sampling_params({"temperature": 0.0, "top_k": 50})
    assert (g.temperature, g.top_k) == (1.0, 1)
    assert parse_sampling_params({"top_k": 1 << 30}).top_k == -1
    s = parse_sampling_params({"stop_token_ids": [7, 3, 7], "sampling_seed": 11, "max_new_tokens": 5})
    assert s.stop_token_ids == (3, 7) and s.sampling_seed == 11 and s.max_new_tokens == 5


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 0.0},
        {"top_k": 0},
        {"temperature": -1.0},
        {"max_new_tokens": -1},
        {"frequency_penalty": 0.5},
        {"n": 0},
        {"n": 1.5},
        {"ignore_eos": "yes"},
        {"stop": ["</s>"]},
        {"no_such_field": 1},
        {"max_new_tokens": 1.5},
    ],
)
def test_sampling_refusals(params: dict) -> None:
    with pytest.raises(ProtocolError):
        parse_sampling_params(params)


def test_sampling_neutral_and_ignored_fields_accepted() -> None:
    s = parse_sampling_params({"frequency_penalty": 0.0, "n": 1, "stop": [], "skip_special_tokens": False})
    assert s == parse_sampling_params({})


def test_single_and_batch_requests() -> None:
    req = parse_generate_request({"input_ids": [1, 2, 3], "return_logprob": True, "rid": "a"})
    items, is_batch = req.items, req.is_batch
    assert not is_batch and not req.stream and len(items) == 1
    assert items[0] == GenerateItem("a", (1, 2, 3), parse_sampling_params(None), True)

    body = {
        "input_ids": [[1, 2], [3]],
        "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 6, "sampling_seed": 2}],
        "rid": "req",
        "return_logprob": [True, False],
    }
    req = parse_generate_request(body)
    items, is_batch = req.items, req.is_batch
    assert is_batch
    assert [it.rid for it in items] == ["req_0", "req_1"]
    assert [it.sampling.max_new_tokens for it in items] == [4, 6]
    assert [it.return_logprob for it in items] == [True, False]
    # one sampling_params dict is shared by every prompt
    items = parse_generate_request({"input_ids": [[1], [2]], "sampling_params": {"top_k": 5}}).items
    assert [it.sampling.top_k for it in items] == [5, 5]


def test_n_samples_text_and_logprob_options() -> None:
    # n samples per prompt, prompt-major, each with a fresh rid (SGLang's expansion); always a list
    req = parse_generate_request({"input_ids": [[1], [2]], "sampling_params": {"n": 3}, "rid": "r"})
    assert req.is_batch and [it.input_ids for it in req.items] == [(1,)] * 3 + [(2,)] * 3
    assert all(it.rid is None for it in req.items)
    assert parse_generate_request({"input_ids": [5], "sampling_params": {"n": 2}}).is_batch
    # text goes through the server's tokenizer
    req = parse_generate_request({"text": ["a b", "c"], "stream": True}, lambda t: [len(w) for w in t.split()])
    assert req.stream and [it.input_ids for it in req.items] == [(1, 1), (1,)]
    req = parse_generate_request(
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    )
    assert (req.items[0].logprob_start_len, req.items[0].top_logprobs_num) == (0, 3)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hello"},  # no tokenizer
        {"text": "hello", "input_ids": [1]},
        {"input_ids": []},
        {"input_ids": [[1], []]},
        {"input_ids": [[1], [2]], "sampling_params": [{}]},
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
        {"input_ids": [1], "stream": "yes"},
        {"input_ids": [1], "logprob_start_len": -2},
        {"input_ids": [1], "top_logprobs_num": -1},
        {"input_ids": [1], "bogus": 1},
        {"input_ids": ["a"]},
        [1, 2],
    ],
)
def test_request_refusals(body: object) -> None:
    with pytest.raises(ProtocolError):
        parse_generate_request(body)


def test_finish_reason_shapes() -> None:
    assert finish_reason_json("length", [5, 6], 2) == {"type": "length", "length": 2}
    assert finish_reason_json("stop", [5, 9], 8) == {"type": "stop", "matched": 9}
    assert finish_reason_json("", [5], 8) is None  # still running (a stream chunk)


def test_fp32_logprobs_survive_json_bit_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    lps = -torch.rand(4096, generator=g, dtype=torch.float32) * 30
    lps = torch.cat([lps, torch.tensor([0.0, -1e-45, -3.4028235e38, -1.1754944e-38], dtype=torch.float32)])
    ids = list(range(len(lps)))
    item = GenerateItem("r", (1,), parse_sampling_params({"max_new_tokens": len(ids)}), True)
    out = build_generate_output("r", item, GenResult(ids, lps, "length"), "v0")
    wire = json.loads(json.dumps(out))
    assert wire["meta_info"]["output_token_logprobs"][3] == [lps[3].item(), 3, None]
    parsed = parse_generate_output(wire)
    back = torch.tensor(parsed["output_logprobs"], dtype=torch.float32)
    assert torch.equal(back.view(torch.int32), lps.view(torch.int32))
    assert parsed["finish_reason"] == "length" and parsed["output_ids"] == ids


def test_output_meta_info_matches_sglang_names() -> None:
    item = GenerateItem("x", (1, 2, 3), parse_sampling_params({"max_new_tokens": 2}), True)
    out = build_generate_output("x", item, _result([4, 5], [-0.5, -0.25]), "w1")
    assert set(out) == {"output_ids", "meta_info"}  # no tokenizer: no text
    meta = out["meta_info"]
    assert meta["id"] == "x" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 2
    assert meta["output_token_logprobs"] == [[-0.5, 4, None], [-0.25, 5, None]]
    assert meta["weight_version"] == "w1"
    no_lp = build_generate_output("x", GenerateItem("x", (1,), item.sampling, False), _result([4], [-1.0]), "w")
    assert "output_token_logprobs" not in no_lp["meta_info"]
    # with a tokenizer: text, and prompt/top logprobs in SGLang's triples (first prompt token: null)
    item = GenerateItem("y", (7, 8, 9), item.sampling, True, logprob_start_len=0, top_logprobs_num=1)
    res = GenResult(
        [4],
        torch.tensor([-0.5]),
        "stop",
        output_top_logprobs=[[(-0.5, 4)]],
        prompt_logprobs={1: -2.0, 2: -3.0},
        prompt_top_logprobs={1: [(-1.0, 5)], 2: [(-1.5, 6)]},
    )
    out = build_generate_output("y", item, res, "w", lambda ids: " ".join(map(str, ids)), True)
    assert out["text"] == " 4" and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 4}
    assert out["meta_info"]["input_token_logprobs"] == [[None, 7, "7"], [-2.0, 8, "8"], [-3.0, 9, "9"]]
    assert out["meta_info"]["input_top_logprobs"] == [None, [[-1.0, 5, "5"]], [[-1.5, 6, "6"]]]
    assert out["meta_info"]["output_top_logprobs"] == [[[-0.5, 4, "4"]]]


def test_client_parse_rejects_mismatched_logprob_ids() -> None:
    bad = {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None], [-1.0, 3, None]]}}
    with pytest.raises(ProtocolError):
        parse_generate_output(bad)


def test_client_parses_a_real_sglang_text_mode_answer() -> None:
    # The shape SGLang's tokenizer manager answers with when it has a tokenizer (text + output_ids)
    # and orjson's null for a non-finite logprob.
    answer = {
        "text": " Paris",
        "output_ids": [12366, 13],
        "meta_info": {
            "id": "9f1c",
            "finish_reason": {"type": "stop", "matched": 13},
            "prompt_tokens": 6,
            "weight_version": "default",
            "total_retractions": 0,
            "input_token_logprobs": [[None, 785, None]],
            "output_token_logprobs": [[-0.0123, 12366, None], [None, 13, None]],
            "completion_tokens": 2,
            "cached_tokens": 0,
            "e2e_latency": 0.05,
        },
    }
    parsed = parse_generate_output(answer)
    assert parsed["output_ids"] == [12366, 13] and parsed["finish_reason"] == "stop"
    assert parsed["output_logprobs"][0] == -0.0123 and parsed["output_logprobs"][1] != parsed["output_logprobs"][1]
