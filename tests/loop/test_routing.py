"""Routing agreement and the routes' plumbing, without a model: the agreement counts (token, MoE layer)
pairs at the response-predicting positions only; the client asks for routes only for an MoE model and
the Batch carries them decoded; the trainer's recorded routes reach rank 0 by response index; router
replay lays the rollout's routes out in megatron's token order; the table shows the column only for MoE
runs; validation refuses replay under the exact contract, saying why."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.records import step_table
from tonpolicy.loop.gate_policy import routing_agreement
from tonpolicy.loop.rollout_batch import collect_batch
from tonpolicy.ports import free_port
from tonpolicy.trainer import routes
from tonpolicy.trainer.cp_layout import ResponseSlice
from tonpolicy.trainer.schedule import Microbatch
from tonpolicy.validation.validate import ConfigError, validate

K = 2


def _routes(n: int, layers: int = 3, seed: int = 0) -> torch.Tensor:
    """int32 [n, layers, K], layer 0 dense (-1), the others two distinct experts ascending."""
    g = torch.Generator().manual_seed(seed)
    t = torch.stack([torch.randperm(8, generator=g)[:K].sort().values for _ in range(n * layers)]).view(n, layers, K)
    t[:, 0] = -1
    return t.to(torch.int32)


def test_agreement_counts_response_positions_and_moe_layers_only() -> None:
    prompt, resp = 5, 4
    rollout = _routes(prompt + resp - 1)
    trainer = rollout[prompt - 1 :].clone()
    moe = [1, 2]
    assert routing_agreement([rollout], [trainer], [prompt], moe) == 1.0
    # the same set listed in another order agrees
    swapped = trainer.flip(-1)
    assert routing_agreement([rollout], [swapped], [prompt], moe) == 1.0
    # a prompt position the trainer did not score, and a dense layer, do not count
    r2 = rollout.clone()
    r2[0, 1] = torch.tensor([6, 7])
    r2[prompt - 1 :, 0] = 3
    assert routing_agreement([r2], [trainer], [prompt], moe) == 1.0
    # one (token, layer) pair of 4 tokens x 2 MoE layers differs: 7/8
    t2 = trainer.clone()
    t2[2, 2] = torch.tensor([0, 1]) if t2[2, 2].tolist() != [0, 1] else torch.tensor([0, 2])
    assert routing_agreement([rollout], [t2], [prompt], moe) == 7 / 8
    # two samples: pairs are pooled
    other = _routes(3 + 2 - 1, seed=1)
    assert routing_agreement([rollout, other], [t2, other[2:]], [prompt, 3], moe) == 11 / 12
    assert routing_agreement([], [], [], moe) is None
    with pytest.raises(ValueError, match="do not fit"):
        routing_agreement([rollout[:-1]], [trainer], [prompt], moe)


class _Client:
    def __init__(self, num_layers: int) -> None:
        self.num_layers, self.kwargs = num_layers, []

    def generate(self, prompts: list[list[int]], params: list[dict], **kw: Any) -> list[dict]:
        self.kwargs.append(kw)
        outs = []
        for i, p in enumerate(prompts):
            out = {"output_ids": [3, 4, 5], "output_logprobs": [-0.5] * 3, "weight_versions": ["default"] * 3}
            if kw.get("return_routed_experts"):
                table = torch.full((len(p) + 2, self.num_layers, K), i, dtype=torch.int32)
                out["routed_experts"] = base64.b64encode(table.numpy().tobytes()).decode()
            outs.append(out)
        return outs


def test_client_asks_for_routes_only_for_moe_and_batch_carries_them() -> None:
    moe = compose_config(["model=qwen3_moe_tiny", "experiment=parity_smoke"])
    client = _Client(moe.model.num_layers)
    batch = collect_batch(moe, client, 0)
    assert client.kwargs == [{"return_routed_experts": True}]
    assert batch.routed_experts is not None and len(batch.routed_experts) == len(batch.prompts)
    for i, (p, t) in enumerate(zip(batch.prompts, batch.routed_experts, strict=True)):
        assert t.dtype == torch.int32 and t.shape == (len(p) + 2, moe.model.num_layers, moe.model.num_experts_per_tok)
        assert bool((t == i).all())
    dense = compose_config(["experiment=parity_smoke"])
    client = _Client(dense.model.num_layers)
    assert collect_batch(dense, client, 0).routed_experts is None and client.kwargs == [{}]


@pytest.fixture()
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    monkeypatch.setattr(routes.ps, "get_tensor_model_parallel_rank", lambda: 0)
    yield
    dist.destroy_process_group()


def _mb(samples: list[int], rows: list[int], slices: list[ResponseSlice], shape: tuple[int, int], w: float = 1.0):
    return Microbatch(samples, torch.zeros(shape, dtype=torch.long), torch.zeros(shape), rows, slices, [], [], w)


def test_gather_routes_picks_the_response_rows_by_response_index(one_rank: None) -> None:
    # microbatch 0: two padded rows of length 6 (samples 1 and 0); microbatch 1: a filler (ignored)
    s = 6
    mbs = [
        _mb(
            [1, 0],
            [0, 1],
            [
                ResponseSlice(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2])),
                ResponseSlice(torch.tensor([4, 5]), torch.tensor([1, 0])),
            ],
            (2, s),
        ),  # fmt: skip
        _mb([1], [0], [ResponseSlice(torch.tensor([0]), torch.tensor([0]))], (1, s), 0.0),
    ]
    rec = routes.RouteRecorder(torch.nn.Module())
    flat = torch.arange(s * 2, dtype=torch.int32)[:, None].expand(-1, K)  # token t (seq-major) -> expert id t
    rec.calls = {1: [flat, torch.full((s, K), 99, dtype=torch.int32)]}
    out = routes.gather_routes(rec, mbs, [2, 3], num_layers=2, top_k=K)
    assert out is not None and [tuple(t.shape) for t in out] == [(2, 2, K), (3, 2, K)]
    assert bool((out[0][:, 0] == -1).all()) and bool((out[1][:, 0] == -1).all())  # a layer nobody recorded
    # sample 1 (row 0): positions 3, 4, 5 -> flat 6, 8, 10; sample 0 (row 1): positions 4 -> resp 1, 5 -> resp 0
    assert out[1][:, 1, 0].tolist() == [6, 8, 10]
    assert out[0][:, 1, 0].tolist() == [11, 9]


def test_replay_targets_lay_out_padded_and_packed_rows() -> None:
    r0 = torch.tensor([[[-1, -1], [2, 5]], [[-1, -1], [1, 3]], [[-1, -1], [0, 7]]], dtype=torch.int32)  # 3 fed
    r1 = torch.tensor([[[-1, -1], [4, 6]], [[-1, -1], [5, 6]]], dtype=torch.int32)  # 2 fed
    padded = _mb([0, 1], [0, 1], [], (2, 4))
    t = routes.replay_targets(padded, [r0, r1], layer=1, top_k=K).view(4, 2, K)  # [s, rows, k]
    assert t.dtype == torch.long
    assert t[:3, 0].tolist() == [[2, 5], [1, 3], [0, 7]] and t[:2, 1].tolist() == [[4, 6], [5, 6]]
    assert t[3, 0].tolist() == [0, 1] and t[2:, 1].tolist() == [[0, 1], [0, 1]]  # padding: experts 0..k-1
    packed = _mb([1, 0], [0, 0], [], (1, 6))
    t = routes.replay_targets(packed, [r0, r1], layer=1, top_k=K)
    assert t.tolist() == [[4, 6], [5, 6], [2, 5], [1, 3], [0, 7], [0, 1]]
    with pytest.raises(ValueError, match="no rollout route"):
        routes.replay_targets(padded, [r0, r1], layer=0, top_k=K)


def test_step_table_has_the_routing_column_only_for_moe_records() -> None:
    base = {"step": 0, "tokens_scored": 4, "mismatched_tokens": 1, "max_abs_logprob_diff": 0.5}
    dense = step_table([base])
    assert "routing_agree" not in dense
    moe = step_table([{**base, "routing_agreement": 0.875}, {**base, "step": 1, "routing_agreement": None}])
    header, _, row0, row1 = moe.splitlines()
    cells = [c.strip() for c in header.split("|")[1:-1]]
    assert cells.index("routing_agree") == cells.index("mismatched") + 1
    assert "0.8750" in row0 and [c.strip() for c in row1.split("|")[1:-1]][cells.index("routing_agree")] == "-"


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides), check_hf=False)
    return str(info.value)


def test_router_replay_is_for_the_off_policy_control_of_an_moe_model() -> None:
    text = _problems(["model=qwen3_moe_tiny", "trainer.router_replay=true"])
    assert "trainer.router_replay=True: contract qwen3_moe_v2 promises exact zero" in text
    assert "would hide a routing disagreement" in text
    assert "is dense: there are no routes to replay" in _problems(["contract=off_policy", "trainer.router_replay=true"])
    validate(
        compose_config(["model=qwen3_moe_tiny", "contract=off_policy", "trainer.router_replay=true"]), check_hf=False
    )
