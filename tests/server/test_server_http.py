"""The rollout server over real HTTP on loopback: every endpoint, SGLang shapes, exact logprobs,
concurrent requests batched into one engine loop, and weight updates from disk."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.server_proc import DTYPE, IDENTITY, ServerProc, local_engine, save_checkpoint

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.rollout.client import RolloutClient, RolloutError
from tonpolicy.rollout.engine.generation import GenRequest

MAX_NEW = 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ckpts")
    return {
        "a": save_checkpoint(d / "a", seed=1),
        "b": save_checkpoint(d / "b", seed=2),
        "other_arch": save_checkpoint(d / "other", seed=1, cfg=ModelConfig(num_layers=2)),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, ckpts: dict[str, Path]) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("server")
    args = ["--model-path", str(ckpts["a"]), "--kernels", "ordered", "--dtype", DTYPE, *IDENTITY]
    # Token ids only, as the run plan starts it (the text API: tests/server/test_server_text_api.py).
    srv = ServerProc(tmp, "main", [*args, "--num-threads", "1", "--max-running-requests", "4", "--skip-tokenizer-init"])
    srv.start_healthy()
    yield srv
    code = srv.stop()
    assert code == 0, f"SIGTERM should end the server cleanly, got {code}:\n{srv.log()}"


@pytest.fixture(scope="module")
def client(server: ServerProc) -> RolloutClient:
    return RolloutClient(f"http://127.0.0.1:{server.port}")


def http(client: RolloutClient, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(client.base_url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload) if payload else None
    except json.JSONDecodeError:
        return status, payload.decode()


def requests_for(prompts: list[list[int]], seeds: list[int], **kw: Any) -> list[GenRequest]:
    return [GenRequest(p, MAX_NEW, seed=s, **kw) for p, s in zip(prompts, seeds, strict=True)]


PROMPTS = [[5, 17, 300, 42], [9, 8, 7], [1000, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
SEEDS = [11, 12, 13]


def test_health_info_and_cache_endpoints(client: RolloutClient, server: ServerProc) -> None:
    assert http(client, "GET", "/health") == (200, None)
    assert http(client, "GET", "/health_generate") == (200, None)
    info = client.server_info()
    assert info["tonpolicy_contract"] == {"name": "test_contract", "version": 1, "fingerprint": "f" * 64}
    reported = client.contract()  # GET /tonpolicy/contract: the label plus what the server built
    assert {k: reported[k] for k in ("name", "version", "fingerprint")} == info["tonpolicy_contract"]
    assert reported["runtime"]["kernels"] == get_kernels("ordered").describe()
    assert reported["runtime"]["dtype"] == DTYPE and reported["runtime"]["build"]["device"] == "cpu"
    for key in ("model_path", "dtype", "host", "port", "tp_size", "max_running_requests", "version"):
        assert key in info, key  # SGLang ServerArgs names
    assert info["port"] == server.port and info["host"] == "127.0.0.1" and info["dtype"] == DTYPE
    assert info["max_running_requests"] == 4 and info["kernels"] == "ordered"
    model = client.model_info()
    assert set(model) >= {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    }
    assert model["is_generation"] is True and model["model_config"]["vocab_size"] == ModelConfig().vocab_size
    assert http(client, "GET", "/get_weight_version") == (200, {"weight_version": "default"})
    status, text = http(client, "POST", "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed")
    assert http(client, "GET", "/flush_cache")[0] == 200
    client.flush_cache()
    assert http(client, "GET", "/no_such_endpoint")[0] == 404
    assert http(client, "GET", "/generate")[0] == 405


def test_generate_single_and_batch_shapes(client: RolloutClient) -> None:
    single = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "rid": "r1",
    }
    status, out = http(client, "POST", "/generate", single)
    assert status == 200 and isinstance(out, dict) and set(out) == {"output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[2] is None and isinstance(t[0], float) for t in meta["output_token_logprobs"])

    status, outs = http(client, "PUT", "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and isinstance(outs, list) and len(outs) == 3
    assert all("output_token_logprobs" not in o["meta_info"] for o in outs)  # return_logprob not set
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in PROMPTS]

    status, out = http(client, "POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_ends_with_sglang_finish_reason(client: RolloutClient) -> None:
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    first = client.generate([PROMPTS[1]], greedy)[0]["output_ids"][0]
    status, out = http(
        client,
        "POST",
        "/generate",
        {
            "input_ids": PROMPTS[1],
            "sampling_params": {**greedy, "stop_token_ids": [first]},
            "return_logprob": True,
        },
    )
    assert status == 200 and out["output_ids"] == [first]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert client.generate([PROMPTS[1]], {**greedy, "stop_token_ids": [first]})[0]["finish_reason"] == "stop"


def test_logprobs_bit_identical_to_the_engine(client: RolloutClient, ckpts: dict[str, Path]) -> None:
    params = [{"max_new_tokens": MAX_NEW, "sampling_seed": s} for s in SEEDS]
    outs = client.generate(PROMPTS, params)
    expected = local_engine(ckpts["a"]).generate(requests_for(PROMPTS, SEEDS))
    for out, exp in zip(outs, expected, strict=True):
        assert out["output_ids"] == exp.output_ids
        assert torch.equal(torch.tensor(out["output_logprobs"], dtype=torch.float32), exp.output_logprobs.float())
        assert out["finish_reason"] == exp.finish_reason == "length"


def test_concurrent_requests_share_engine_batches(client: RolloutClient, ckpts: dict[str, Path]) -> None:
    n = 8
    prompts = [[(7 * i + j) % 2003 for j in range(3 + i)] for i in range(n)]
    seeds = list(range(100, 100 + n))
    before = client.server_info()["internal_states"][0]
    results: list[dict | None] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        try:
            barrier.wait()
            results[i] = client.generate([prompts[i]], {"max_new_tokens": MAX_NEW, "sampling_seed": seeds[i]})[0]
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    after = client.server_info()["internal_states"][0]
    assert after["requests_run"] - before["requests_run"] == n
    assert after["batches_run"] - before["batches_run"] < n, "concurrent requests were never batched together"
    assert after["largest_batch"] >= 2
    expected = local_engine(ckpts["a"]).generate(requests_for(prompts, seeds))
    for got, exp in zip(results, expected, strict=True):
        assert got["output_ids"] == exp.output_ids
        assert torch.equal(torch.tensor(got["output_logprobs"], dtype=torch.float32), exp.output_logprobs)


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, 2, 5000]},  # out of vocab
        {"input_ids": [1] * 1020, "sampling_params": {"max_new_tokens": 10}},  # past the context
        {"text": "hello"},
        {"input_ids": [1], "sampling_params": {"presence_penalty": 1.0}},
        {"input_ids": [1], "stream": "yes"},
    ],
)
def test_bad_requests_are_400_and_harmless(client: RolloutClient, body: dict) -> None:
    status, out = http(client, "POST", "/generate", body)
    assert status == 400 and out["error"]["message"]
    assert client.health()


def test_malformed_json_is_400(client: RolloutClient) -> None:
    status, out = http(client, "POST", "/generate", raw=b"{not json")
    assert status == 400 and "JSON" in out["error"]["message"]


def test_weight_update_from_disk(client: RolloutClient, ckpts: dict[str, Path]) -> None:
    params = [{"max_new_tokens": MAX_NEW, "sampling_seed": s} for s in SEEDS]
    before = client.generate(PROMPTS, params)
    try:
        answer = client.update_weights_from_disk(str(ckpts["b"]), weight_version="step_1")
        assert answer["success"] is True and "step_1" in answer["message"]
        after = client.generate(PROMPTS, params)
        assert all(o["weight_version"] == "step_1" for o in after)
        assert [o["output_logprobs"] for o in after] != [o["output_logprobs"] for o in before]
        expected = local_engine(ckpts["b"]).generate(requests_for(PROMPTS, SEEDS))
        for out, exp in zip(after, expected, strict=True):
            assert out["output_ids"] == exp.output_ids
            assert torch.equal(torch.tensor(out["output_logprobs"], dtype=torch.float32), exp.output_logprobs)
        assert client.model_info()["model_path"] == str(ckpts["b"])

        # Refused checkpoints answer SGLang's {success: false} with 400 and leave the weights alone.
        for bad in (ckpts["a"].parent / "missing", ckpts["other_arch"]):
            status, out = http(client, "POST", "/update_weights_from_disk", {"model_path": str(bad)})
            assert status == 400 and out["success"] is False and str(bad) in out["message"]
            # no file system details beyond the path the client gave (errno, files it resolved)
            assert "Errno" not in out["message"] and "config.json" not in out["message"], out
            with pytest.raises(RolloutError):
                client.update_weights_from_disk(str(bad))
        # the same samples (now served from the prefix cache, which a refused update leaves alone)
        again = client.generate(PROMPTS, params)
        assert [{**o, "cached_tokens": 0} for o in again] == [{**o, "cached_tokens": 0} for o in after]
    finally:
        client.update_weights_from_disk(str(ckpts["a"]), weight_version="default")
    restored = client.generate(PROMPTS, params)
    assert [o["output_logprobs"] for o in restored] == [o["output_logprobs"] for o in before]


def _raw_request(server: ServerProc, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes the way a hostile client would; return (status, body)."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        data = b""
        while True:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in data[:head_end].split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                if len(data) >= head_end + 4 + length:
                    break
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize(("head", "body", "status", "message"), [
    ("POST /generate HTTP/1.1\r\nContent-Length: abc", b"", 400, b"Content-Length 'abc'"),
    ("POST /generate HTTP/1.1\r\nContent-Length: -1", b"", 400, b"Content-Length '-1'"),
    ("POST /generate HTTP/1.1\r\nContent-Length: 1000000000000", b"", 413, b"exceeds"),
    ("POST /generate HTTP/1.1\r\nContent-Length: 4", b"\xff\xfe\xfd\xfc", 400, b"not UTF-8"),
    ("POST /generate HTTP/1.1\r\nContent-Length: 200000", b"[" * 100000 + b"]" * 100000, 400, b"nests too deeply"),
])  # fmt: skip
def test_malformed_requests_get_a_4xx(server: ServerProc, head: str, body: bytes, status: int, message: bytes) -> None:
    got, payload = _raw_request(server, head, body)
    assert got == status and message in payload, (got, payload[:300])


def test_a_bad_seed_is_refused_at_admission_and_fails_no_one_else(client: RolloutClient) -> None:
    """sampling_seed >= 2**64 used to fail every request batched with it (500 to innocent clients)."""
    results: dict[str, Any] = {}

    def good() -> None:
        results["good"] = client.generate([[1, 2, 3]], {"max_new_tokens": MAX_NEW, "sampling_seed": 5})

    t = threading.Thread(target=good)
    t.start()
    status, body = http(
        client,
        "POST",
        "/generate",
        {
            "input_ids": [[4, 5], [6, 7]],
            "return_logprob": True,
            "sampling_params": [{"max_new_tokens": MAX_NEW}, {"max_new_tokens": MAX_NEW, "sampling_seed": 2**64}],
        },
    )
    t.join(timeout=120)
    assert status == 400 and "sampling_seed must be in [0, 2**63)" in body["error"]["message"]
    assert len(results["good"][0]["output_ids"]) == MAX_NEW


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = ["input_ids", "sampling_params", "return_logprob", "rid", "stream", "text", "lora_path"]
_SAMPLING = ["max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed", "stop_token_ids", "n"]
_BODIES = st.one_of(
    _JSON,  # anything JSON at all
    st.fixed_dictionaries(
        {"input_ids": st.lists(st.integers(-3, 2100), max_size=6)}, optional={k: _JSON for k in _FIELDS[1:]}
    ),
    st.fixed_dictionaries(
        {
            "input_ids": st.just([1, 2, 3]),
            "sampling_params": st.dictionaries(st.sampled_from(_SAMPLING), _JSON | st.integers(-5, 40), max_size=4),
        }
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_BODIES)
def test_no_request_body_breaks_the_server(client: RolloutClient, body: Any) -> None:
    """Fuzzed /generate bodies: the server answers each with 200 or a 4xx naming the problem, never a
    5xx, and stays healthy for the next."""
    status, out = http(client, "POST", "/generate", body)
    assert status == 200 or (400 <= status < 500 and out["error"]["message"]), (status, out, body)
    assert client.health()
