"""The embedded engine's graph decode path (padded batch-size buckets over static device buffers,
`rollout/engine/graphs.py`) run eagerly, as on a GPU before capture: under the `triton` set (Triton's
interpreter on this CPU) every sampled token's logprob bits equal eager decode's and the full-sequence
forward's, whichever bucket a row was padded into. Negative control: under `plain` the same path
misses the full forward. CUDA-graph capture and replay themselves: tests/engine/test_decode_graphs_gpu.py
and experiments/gpu/graph_check.py (on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3
from tonpolicy.rollout.engine import Engine, GenRequest, score_logprobs
from tonpolicy.rollout.engine.graphs import DecodeGraphs, buckets

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
# Small enough for the interpreter: 2 layers, GQA 4/2 heads of 32, vocab of 3 logprob lanes.
CFG = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128,
    vocab_size=300, max_position_embeddings=128,
)  # fmt: skip
MAX_RUNNING = 4  # buckets 1, 2, 4: three decoding rows pad to 4


def requests() -> list[GenRequest]:
    # Prompt lengths across a key tile (64); outputs of different lengths, so decode-only steps run
    # 3, 2 and 1 rows (buckets 4, 2, 1).
    lengths, outs = (5, 66, 12), (4, 3, 2)
    return [
        GenRequest(prompt_ids=[(7 * i + 3 * j) % CFG.vocab_size for j in range(n)], max_new_tokens=m, seed=i)
        for i, (n, m) in enumerate(zip(lengths, outs, strict=True))
    ]


def run(kernels: str, dtype: torch.dtype) -> tuple[list, list, Engine, Qwen3]:
    model = Qwen3(CFG, get_kernels(kernels, **({"attention_tile": 64} if kernels == "triton" else {})), dtype)
    eager = Engine(model, max_running_requests=MAX_RUNNING).generate(requests())
    engine = Engine(
        model, max_running_requests=MAX_RUNNING, decode_graphs=DecodeGraphs(model, MAX_RUNNING, capture=False)
    )
    padded = engine.generate(requests())
    return eager, padded, engine, model


def full_forward_mismatches(model: Qwen3, results: list) -> int:
    bad = 0
    for req, res in zip(requests(), results, strict=True):
        ref = score_logprobs(model, req.prompt_ids, res.output_ids, req.temperature)
        bad += int((ref.view(torch.int32) != res.output_logprobs.view(torch.int32)).sum())
    return bad


def test_buckets() -> None:
    assert buckets(1) == [1] and buckets(4) == [1, 2, 4] and buckets(6) == [1, 2, 4, 6]


@pytest.mark.slow  # ~40-50 s: Triton's interpreter
def test_padded_static_decode_is_bit_equal_to_eager_and_full_forward() -> None:
    eager, padded, engine, model = run("triton", torch.float32)
    graphs = engine.decode_graphs
    assert graphs is not None and engine.graph_steps > 0
    assert set(graphs.replays) == {1, 2, 4}, graphs.replays  # every bucket, 3 rows padded to 4
    for e, p in zip(eager, padded, strict=True):
        assert e.output_ids == p.output_ids
        assert torch.equal(e.output_logprobs.view(torch.int32), p.output_logprobs.view(torch.int32))
    assert full_forward_mismatches(model, padded) == 0


def test_negative_control_plain_kernels_miss_the_full_forward() -> None:
    _, padded, engine, model = run("plain", torch.bfloat16)
    assert engine.graph_steps > 0
    assert full_forward_mismatches(model, padded) > 0
