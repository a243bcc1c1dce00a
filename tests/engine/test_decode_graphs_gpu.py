"""CUDA-graph decode of the embedded engine on a GPU (skipped without one): under the `triton` set, every
token's logprob bits from graph replay equal eager decode's and the full-sequence forward's, for batch
sizes that fill a bucket and ones padded into it; plain kernels miss the full forward (control). The
same checks with the Megatron trainer's forward and timings: experiments/gpu/graph_check.py."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3
from tonpolicy.rollout.engine import Engine, GenRequest, score_logprobs
from tonpolicy.rollout.engine.graphs import DecodeGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]
MAX_RUNNING = 8


def _requests(n: int) -> list[GenRequest]:
    return [
        GenRequest(
            prompt_ids=[(11 * i + 5 * j) % 2000 for j in range(3 + 29 * i)],
            max_new_tokens=12,
            temperature=0.8,
            seed=i,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def _bits(results: list) -> list[torch.Tensor]:
    return [r.output_logprobs.view(torch.int32) for r in results]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_replay_bits_equal_eager_and_full_forward(dtype: torch.dtype) -> None:
    model = Qwen3(ModelConfig(), get_kernels("triton", attention_tile=64), dtype).cuda()
    graphs = DecodeGraphs(model, MAX_RUNNING, capture=True)
    graphed = Engine(model, max_running_requests=MAX_RUNNING, prefix_cache=False, decode_graphs=graphs)
    eager = Engine(model, max_running_requests=MAX_RUNNING, prefix_cache=False)
    for n in (1, 3, 4, 6):  # buckets 1, 4, 4, 8
        reqs = _requests(n)
        want = eager.generate(reqs)
        for _ in range(2):  # the first run captures, the second replays
            got = graphed.generate(reqs)
            assert [r.output_ids for r in got] == [r.output_ids for r in want]
            assert all(torch.equal(a, b) for a, b in zip(_bits(got), _bits(want), strict=True))
        for q, r in zip(reqs, got, strict=True):
            full = score_logprobs(model, q.prompt_ids, r.output_ids, q.temperature)
            assert torch.equal(full.view(torch.int32), r.output_logprobs.view(torch.int32))
    assert set(graphs.capture_s) == {1, 4, 8} and graphed.graph_steps > 0


def test_negative_control_plain_kernels_miss_the_full_forward() -> None:
    model = Qwen3(ModelConfig(), get_kernels("plain"), torch.bfloat16).cuda()
    engine = Engine(
        model, max_running_requests=MAX_RUNNING, decode_graphs=DecodeGraphs(model, MAX_RUNNING, capture=False)
    )
    reqs = _requests(6)
    bad = 0
    for q, r in zip(reqs, engine.generate(reqs), strict=True):
        full = score_logprobs(model, q.prompt_ids, r.output_ids, q.temperature)
        bad += int((full.view(torch.int32) != r.output_logprobs.view(torch.int32)).sum())
    assert bad > 0
