"""Engine behaviour: greedy/top-k/top-p/temperature sampling, per-request seeds, stop ids and EOS,
length limits, arrival steps, the running cap, and request validation."""

from __future__ import annotations

import pytest
import torch
from support.kernel_utils import num_threads

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3
from tonpolicy.rollout.engine import Engine, GenRequest
from tonpolicy.rollout.engine.logits import make_generator, sample_token

CFG = ModelConfig()
PROMPT = [5, 17, 300, 42, 1999, 7, 8]


@pytest.fixture(scope="module")
def m() -> Qwen3:
    return Qwen3(CFG, get_kernels("ordered"), torch.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):
        yield


def test_greedy_is_argmax_of_full_forward(m):
    r = Engine(m, max_running_requests=2).generate([GenRequest(PROMPT, 10, temperature=0.0)])[0]
    logits = m(torch.tensor(PROMPT + r.output_ids))
    p = len(PROMPT)
    want = logits[p - 1 : p - 1 + 10, : CFG.vocab_size].argmax(-1).tolist()
    assert r.output_ids == want and r.finish_reason == "length"
    top1 = Engine(m, max_running_requests=1).generate([GenRequest(PROMPT, 10, top_k=1, seed=3)])[0]
    tiny_p = Engine(m, max_running_requests=1).generate([GenRequest(PROMPT, 10, top_p=1e-6, seed=4)])[0]
    assert top1.output_ids == want and tiny_p.output_ids == want


def test_seeded_sampling_reproducible_regardless_of_batch(m):
    target = GenRequest(PROMPT, 12, temperature=1.2, top_p=0.95, top_k=200, seed=77)
    others = [GenRequest([i + 1] * (i + 3), 9, seed=i, arrival_step=i % 3) for i in range(5)]
    alone = Engine(m, max_running_requests=1).generate([target])[0]
    for cap, chunk in [(6, None), (2, 4), (3, 16)]:
        res = Engine(m, max_running_requests=cap, chunked_prefill_size=chunk).generate(
            others[:2] + [target] + others[2:]
        )
        assert res[2].output_ids == alone.output_ids
        assert torch.equal(res[2].output_logprobs, alone.output_logprobs)
    other_seed = Engine(m, max_running_requests=1).generate([GenRequest(PROMPT, 12, temperature=1.2, seed=78)])[0]
    assert other_seed.output_ids != alone.output_ids


def test_stop_ids_and_eos(m):
    greedy = Engine(m, max_running_requests=1).generate([GenRequest(PROMPT, 10, temperature=0.0)])[0].output_ids
    stop = greedy[3]
    first = greedy.index(stop)
    r = Engine(m, max_running_requests=1).generate([GenRequest(PROMPT, 10, temperature=0.0, stop_token_ids=(stop,))])[0]
    assert r.output_ids == greedy[: first + 1] and r.finish_reason == "stop"
    assert len(r.output_logprobs) == first + 1
    e = Engine(m, max_running_requests=1, eos_token_id=stop).generate([GenRequest(PROMPT, 10, temperature=0.0)])[0]
    assert e.output_ids == r.output_ids and e.finish_reason == "stop"


def test_lengths_arrivals_and_cap(m):
    reqs = [GenRequest(PROMPT, 0), GenRequest(PROMPT, 1, arrival_step=50), GenRequest([3], 5, arrival_step=2)]
    eng = Engine(m, max_running_requests=1)
    res = eng.generate(reqs)
    assert res[0].output_ids == [] and res[0].finish_reason == "length" and res[0].output_logprobs.numel() == 0
    assert len(res[1].output_ids) == 1 and len(res[2].output_ids) == 5
    assert eng.steps_run == 6  # idle gaps are skipped, not stepped through


def test_request_validation(m):
    eng = Engine(m, max_running_requests=1)
    with pytest.raises(ValueError):
        eng.generate([GenRequest([], 3)])
    with pytest.raises(ValueError):
        eng.generate([GenRequest([1] * 1000, CFG.max_position_embeddings)])
    with pytest.raises(ValueError):
        eng.generate([GenRequest([CFG.vocab_size], 3)])
    with pytest.raises(ValueError):
        Engine(m, max_running_requests=0)


def test_sample_token_filters():
    logits = torch.linspace(0, 8, 2048)
    logits[2003:] = 100.0  # padding is never sampled
    g = make_generator(0)
    topk = {sample_token(logits, 2003, 1.0, 1.0, 5, g) for _ in range(300)}
    assert topk <= set(range(1998, 2003)) and len(topk) > 1
    topp = {sample_token(logits, 2003, 1.0, 0.5, -1, g) for _ in range(300)}
    probs = torch.softmax(logits[:2003], -1).flip(0)
    keep = int((torch.cumsum(probs, 0) - probs < 0.5).sum())  # smallest prefix reaching 0.5
    assert min(topp) >= 2003 - keep and len(topp) > 20
    assert sample_token(logits, 2003, 0.0, 1.0, -1, g) == 2002
    a = [sample_token(logits, 2003, 2.0, 1.0, -1, make_generator(9)) for _ in range(3)]
    assert len(set(a)) == 1
