"""The embedded engine's prefix cache (a later turn of a conversation reuses the earlier turn's K/V).

Exact reuse needs a position's K/V to have the same bits whether a decode step (one row) or a prefill
(many rows) wrote them, bf16 cache storage included, and the later turn's logprobs to have the same
bits with the cache on and off. Both hold under `invariant`; under `plain` (library GEMMs whose bits
follow the row count) the decode-written K/V and the later turn's logprobs differ: the negative control.
"""

from __future__ import annotations

import pytest
import torch
from support.kernel_utils import DTYPES, num_threads

from tonpolicy.config.model import ModelConfig
from tonpolicy.contract.gate import bits_differ
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3
from tonpolicy.model.kv_cache import convert_layout
from tonpolicy.rollout.engine import Engine, GenRequest

CFG = ModelConfig()
PROMPT = [5, 12, 4, 3, 17, 18, 4, 6, 11, 4]  # 10 tokens: the first turn's prompt
ENV = [8, 15, 4]  # what an environment appends after the first turn
_MODELS: dict[tuple[str, torch.dtype], Qwen3] = {}


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):
        yield


def model(kernels: str, dtype: torch.dtype) -> Qwen3:
    if (kernels, dtype) not in _MODELS:
        _MODELS[kernels, dtype] = Qwen3(CFG, get_kernels(kernels), dtype)
    return _MODELS[kernels, dtype]


def request(prompt: list[int], n: int, seed: int = 3, **kw) -> GenRequest:
    return GenRequest(prompt_ids=list(prompt), max_new_tokens=n, seed=seed, ignore_eos=True, top_k=50, **kw)


def slot_kv(eng: Engine, slot: int, n: int) -> list[torch.Tensor]:
    """Every layer's k and v of positions [0, n) of `slot`, [n, Hkv, D] each."""
    pool = eng._pool
    assert pool is not None
    out = []
    for k, v in zip(pool.k, pool.v, strict=True):
        k, v = convert_layout(k, v, pool.layout, "token")
        out += [k[slot, :n], v[slot, :n]]
    return out


def decode_vs_prefill_kv(kernels: str, dtype: torch.dtype) -> tuple[int, int]:
    """(positions compared, K/V elements that differ): turn 1's K/V as its decode steps wrote them vs
    the same tokens' K/V written by one prefill."""
    m = model(kernels, dtype)
    decoded = Engine(m, max_running_requests=1)
    out = decoded.generate([request(PROMPT, 20)])[0].output_ids
    fed = PROMPT + out[:-1]
    assert decoded.cached_prefixes == 1
    prefilled = Engine(m, max_running_requests=1, prefix_cache=False)
    prefilled.generate([request(fed, 1)])
    a, b = slot_kv(decoded, 0, len(fed)), slot_kv(prefilled, 0, len(fed))
    # decode-written positions only (prompt positions were prefilled by both, in prefills of other sizes)
    diff = sum(int(bits_differ(x[len(PROMPT) :], y[len(PROMPT) :]).sum()) for x, y in zip(a, b, strict=True))
    return len(out) - 1, diff


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_written_by_decode_equals_prefill(dtype: torch.dtype) -> None:
    positions, diff = decode_vs_prefill_kv("ordered", dtype)
    assert positions == 19 and diff == 0


def test_kv_written_by_decode_differs_under_plain_kernels() -> None:
    """Negative control: library GEMMs give a row alone (decode) other bits than in a prefill."""
    _, diff = decode_vs_prefill_kv("plain", torch.float32)
    assert diff > 0


def second_turn(kernels: str, dtype: torch.dtype, cache: bool) -> tuple[list[int], torch.Tensor, int]:
    """Turn 1 (prompt -> 12 sampled tokens), the environment's tokens, then turn 2 on one engine: turn 2's
    (ids, logprobs, cached_tokens)."""
    eng = Engine(model(kernels, dtype), max_running_requests=2, prefix_cache=cache)
    first = eng.generate([request(PROMPT, 12, seed=5)])[0]
    second = eng.generate([request(PROMPT + first.output_ids + ENV, 10, seed=6)])[0]
    return second.output_ids, second.output_logprobs, second.cached_tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_second_turn_logprobs_equal_with_cache_on_and_off(dtype: torch.dtype) -> None:
    ids_on, lps_on, cached = second_turn("ordered", dtype, cache=True)
    ids_off, lps_off, none = second_turn("ordered", dtype, cache=False)
    assert cached == len(PROMPT) + 11 and none == 0  # turn 1's prompt and fed outputs came from the cache
    assert ids_on == ids_off
    assert not bits_differ(lps_on, lps_off).any()


def test_second_turn_logprobs_differ_under_plain_kernels() -> None:
    """Negative control: the cache's decode-written K/V change the later turn's logprobs under `plain`."""
    ids_on, lps_on, cached = second_turn("plain", torch.float32, cache=True)
    ids_off, lps_off, _ = second_turn("plain", torch.float32, cache=False)
    assert cached > 0
    n = next((i for i, (a, b) in enumerate(zip(ids_on, ids_off, strict=True)) if a != b), len(ids_on))
    n = max(n, 1)  # compare the logprobs up to the first sampled token that differs (and including it)
    assert bits_differ(lps_on[:n], lps_off[:n]).any()


def test_cache_hits_only_prefixes_and_is_forgotten_on_weight_updates() -> None:
    m = model("ordered", torch.bfloat16)
    eng = Engine(m, max_running_requests=2)
    out = eng.generate([request(PROMPT, 4)])[0].output_ids
    # a prompt that diverges after 3 tokens reuses 3; the whole cached prompt is capped at len - 1
    assert eng.generate([request(PROMPT[:3] + [19, 19], 2)])[0].cached_tokens == 3
    # the request above took the slot (its own prefix is cached now): start again
    eng.generate([request(PROMPT, 4)])
    assert eng.generate([request(PROMPT + out[:1], 2)])[0].cached_tokens == len(PROMPT)
    # prompt logprobs come from the request's own prefill rows: no reuse
    eng.generate([request(PROMPT, 4)])
    asked = eng.generate([request(PROMPT + out, 1, prompt_logprobs_from=0)])[0]
    assert asked.cached_tokens == 0 and len(asked.prompt_logprobs) == len(PROMPT) + len(out) - 1
    # weights change: cached K/V are stale
    from tonpolicy.rollout.server.model import load_checked

    eng.generate([request(PROMPT, 4)])
    state = {k: v.clone() for k, v in m.state_dict().items() if k == "model.norm.weight"}
    load_checked(eng, state, CFG, "test", partial=True)
    assert eng.cached_prefixes == 0
    assert eng.generate([request(PROMPT + out, 2)])[0].cached_tokens == 0
