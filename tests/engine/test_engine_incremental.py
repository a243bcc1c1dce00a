"""The incremental engine API (add / step / has_work): requests added while others are mid-decode get
results bit-identical (torch.equal) to the request run alone and to one full-sequence forward under
`invariant`, fp32 and bf16; `plain` finds mismatches in the same scenario (negative control). The
add/step schedule is the one `generate` runs: feeding arrivals by hand equals `arrival_step`."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from support.kernel_utils import DTYPES, num_threads

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3
from tonpolicy.rollout.engine import Engine, GenRequest, GenResult, score_logprobs

CFG = ModelConfig()
_MODELS: dict[tuple[str, torch.dtype], Qwen3] = {}


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):  # fast on a shared 2-core box; thread invariance is tested elsewhere
        yield


def model(kernels: str, dtype: torch.dtype) -> Qwen3:
    key = (kernels, dtype)
    if key not in _MODELS:
        _MODELS[key] = Qwen3(CFG, get_kernels(kernels), dtype)
    return _MODELS[key]


def workload(seed: int, n: int = 6) -> tuple[list[GenRequest], list[int], int, int | None]:
    """Requests, the outer step each is added at, the running cap (>= 2, so adds can join), chunk."""
    rng = random.Random(seed)
    reqs, arrivals = [], []
    for i in range(n):
        plen = rng.choice([1, 2, 31, 33, rng.randrange(3, 70)])
        reqs.append(
            GenRequest(
                prompt_ids=[rng.randrange(CFG.vocab_size) for _ in range(plen)],
                max_new_tokens=rng.randrange(4, 20),
                temperature=rng.choice([1.0, 0.8, 0.0]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([-1, 50]),
                seed=rng.randrange(10**6),
                stop_token_ids=tuple(rng.sample(range(CFG.vocab_size), 10)),
            )
        )
        arrivals.append(0 if i == 0 else rng.randrange(1, 14))
    return reqs, arrivals, rng.randrange(2, n + 1), rng.choice([None, 7, 24])


def run_incremental(eng: Engine, reqs: list[GenRequest], arrivals: list[int]) -> tuple[list[GenResult], int]:
    """Add each request at its outer step, between engine steps; (results, adds that joined a batch
    with a request mid-decode)."""
    results: dict[int, GenResult] = {}
    index: dict[int, int] = {}
    joined = step = 0
    while len(results) < len(reqs):
        for i, at in enumerate(arrivals):
            if at == step:
                # Admitted at the next step, next to a request that is decoding.
                joined += int(eng.decoding > 0 and eng.unfinished < eng.max_running)
                index[eng.add(reqs[i])] = i
        for handle, res in eng.step():
            results[index[handle]] = res
        step += 1
    assert not eng.has_work()
    return [results[i] for i in range(len(reqs))], joined


def mismatches(kernels: str, dtype: torch.dtype, seed: int) -> tuple[int, int, int]:
    """(vs full forward, vs run alone, adds that joined mid-decode) for one workload."""
    m = model(kernels, dtype)
    reqs, arrivals, cap, chunk = workload(seed)
    res, joined = run_incremental(Engine(m, max_running_requests=cap, chunked_prefill_size=chunk), reqs, arrivals)
    bad_full = bad_alone = 0
    for q, r in zip(reqs, res, strict=True):
        assert r.output_logprobs.dtype == torch.float32 and 1 <= len(r.output_ids) <= q.max_new_tokens
        bad_full += int(
            not torch.equal(r.output_logprobs, score_logprobs(m, q.prompt_ids, r.output_ids, q.temperature))
        )
        alone = Engine(m, max_running_requests=1).generate([q])[0]
        bad_alone += int(alone.output_ids != r.output_ids or not torch.equal(alone.output_logprobs, r.output_logprobs))
    return bad_full, bad_alone, joined


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_contract_requests_joining_mid_decode_are_bitwise(dtype, seed):
    bad_full, bad_alone, joined = mismatches("ordered", dtype, seed)
    assert joined > 0, "the workload never added a request while another was decoding"
    assert bad_full == 0 and bad_alone == 0


def test_plain_requests_joining_mid_decode_mismatch():
    """Negative control, as tests/engine/test_engine_parity.py: plain kernels show the batch in the numbers."""
    bad = [mismatches("plain", dtype, seed) for dtype in DTYPES for seed in range(2)]
    assert all(b[2] > 0 for b in bad)
    assert sum(b[0] for b in bad) > 0
    assert sum(b[0] + b[1] for b in bad) > 0


@pytest.mark.parametrize("kernels", ["ordered", "plain"])
def test_adding_between_steps_is_the_generate_schedule(kernels):
    """Same batches step for step, so even `plain` agrees bit for bit: one scheduling path."""
    m = model(kernels, torch.bfloat16)
    reqs, arrivals, cap, chunk = workload(7)
    by_hand, _ = run_incremental(Engine(m, max_running_requests=cap, chunked_prefill_size=chunk), reqs, arrivals)
    timed = [replace(q, arrival_step=at) for q, at in zip(reqs, arrivals, strict=True)]
    batch = Engine(m, max_running_requests=cap, chunked_prefill_size=chunk).generate(timed)
    for a, b in zip(by_hand, batch, strict=True):
        assert a.output_ids == b.output_ids and torch.equal(a.output_logprobs, b.output_logprobs)


def test_handles_lifecycle_and_pool_reuse():
    m = model("ordered", torch.bfloat16)
    eng = Engine(m, max_running_requests=2)
    long = eng.add(GenRequest([5, 6, 7], 12, seed=1))
    assert eng.has_work() and eng.step() == [] and eng.step() == []
    assert eng.decoding == 1
    empty = eng.add(GenRequest([1], 0))
    short = eng.add(GenRequest([9] * 40, 2, seed=2))  # needs more positions: the pool grows mid-run
    order = []
    while eng.has_work():
        order += [h for h, _ in eng.step()]
    assert order == [empty, short, long]
    with pytest.raises(ValueError):
        eng.add(GenRequest([CFG.vocab_size], 3))
    eng.add(GenRequest([1, 2], 3))
    with pytest.raises(RuntimeError):
        eng.generate([GenRequest([1], 2)])  # generate needs an idle engine
    assert len(eng.abort()) == 1 and not eng.has_work()
    eng.flush_cache()
    r = eng.generate([GenRequest([5, 6, 7], 12, seed=1)])[0]
    assert eng.steps_run == 12
    alone = Engine(m, max_running_requests=1).generate([GenRequest([5, 6, 7], 12, seed=1)])[0]
    assert r.output_ids == alone.output_ids and torch.equal(r.output_logprobs, alone.output_logprobs)
