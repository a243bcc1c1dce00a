"""Qwen3-MoE on the Megatron trainer with expert parallelism (tonpolicy.trainer.moe_layer).

Fast: the HF <-> Megatron expert weights at every (expert-TP, EP, PP) split; the EP exchange
(trainer.ep_exchange) gives every token its expert outputs bit for bit (signed zeros included) as if all
experts were local, and the same input gradients.
Slow (multi-process, gloo; 8 prompts x 32 tokens per cell): the trainer's logprobs for responses
sampled by the embedded engine's Qwen3Moe are torch.equal to the engine's decode logprobs at tp1, ep2
(dp2), tp2_ep2 and pp2_ep2, fp32 and bf16, and the export reproduces the checkpoint; negative control:
plain kernels in the engine and megatron's stock MoE (router, all-gather dispatcher, SequentialMLP)
mismatch by rounding noise. One PPO step's grad_norm at every EP layout equals tp1's within 5e-6
relative (fp32), also with 7 samples over dp2 x ep2, where the short replica runs a filler microbatch
(loss weight 0) so that its EP exchanges stay in step with the other's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tonpolicy.align import harness
from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict
from tonpolicy.trainer import ep_exchange, moe_weights
from tonpolicy.trainer.process_groups import Layout, spawn
from tonpolicy.trainer.weights import hf_to_megatron, megatron_to_hf

TEMPERATURE = 0.8
PADDED_VOCAB = 2048  # qwen3_moe_tiny's 2003 padded to the contract's multiple


def moe_tiny() -> ModelConfig:
    return compose_config(["model=qwen3_moe_tiny"]).model


# --- weights ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,ep,pp", [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 8, 2), (2, 4, 2), (4, 2, 1)])
def test_moe_weights_round_trip(tp: int, ep: int, pp: int) -> None:
    cfg = moe_tiny()
    hf = init_state_dict(cfg, torch.float32, 3)
    shards, experts = {}, {}
    for t in range(tp):
        for p in range(pp):
            for r in range(ep):
                sd = hf_to_megatron(hf, cfg, t, tp, p, pp, PADDED_VOCAB, ep_rank=r, ep=ep)
                experts[(t, r, p)] = {k: v for k, v in sd.items() if moe_weights.is_expert_param(k)}
                if r == 0:
                    shards[(t, p)] = {k: v for k, v in sd.items() if not moe_weights.is_expert_param(k)}
    back = megatron_to_hf(shards, cfg, tp, pp, experts=experts)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_expert_placement() -> None:
    """Expert e on EP rank e // (E/ep) as local expert e % (E/ep); fc1 [gate shard; up shard] per
    expert-TP rank, fc2 split by columns; the router replicated; layer 2 (mlp_only_layers) dense."""
    cfg = moe_tiny()
    hf = init_state_dict(cfg, torch.float32, 3)
    sd = hf_to_megatron(hf, cfg, 1, 2, 0, 1, PADDED_VOCAB, ep_rank=1, ep=4)  # experts 2, 3 on EP rank 1
    f = cfg.moe_intermediate_size // 2
    layer = "model.layers.0.mlp."
    fc1 = sd["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1[:f], hf[layer + "experts.3.gate_proj.weight"][f:])
    assert torch.equal(fc1[f:], hf[layer + "experts.3.up_proj.weight"][f:])
    fc2 = sd["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, hf[layer + "experts.2.down_proj.weight"][:, f:])
    assert torch.equal(sd["decoder.layers.0.mlp.router.weight"], hf[layer + "gate.weight"])
    assert not any(k.startswith("decoder.layers.0.mlp.experts.local_experts.2") for k in sd)
    assert "decoder.layers.2.mlp.linear_fc1.weight" in sd and "decoder.layers.2.mlp.router.weight" not in sd


# --- the EP exchange ----------------------------------------------------------------------------------
E, K, H = 4, 2, 8


def _compute(owned: list[int]):  # noqa: ANN202  (an ExpertCompute)
    def compute(tokens: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = ep_exchange.empty_outputs(experts, tokens.shape[-1], tokens.device)
        for e in owned:
            rows, slots = torch.nonzero(experts == e, as_tuple=True)
            if not rows.numel():  # as KernelExperts: an expert with no tokens is not run
                continue
            x = tokens.index_select(0, rows)
            y = x * 0.0 if e == 3 else torch.tanh(x * (e + 1.0))  # expert 3: signed zeros (-0.0 where x < 0)
            out.index_put_((rows, slots), y)
        return out

    return compute


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    n = 5 if rank == 0 else 3  # uneven counts: the gather pads
    x = torch.randn(n, H, generator=g, dtype=torch.float64).to(torch.float32)
    experts = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(n)])
    return x, experts


def _exchange(x: torch.Tensor, experts: torch.Tensor) -> list[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    coeff = torch.linspace(-1, 1, K * H).view(1, K, H)
    ref_x = x.clone().requires_grad_()
    ref = _compute(list(range(E)))(ref_x, experts)  # every expert local
    (ref * coeff).sum().backward()
    ep_x = x.clone().requires_grad_()
    per = E // world
    own = list(range(rank * per, rank * per + per))
    out = ep_exchange.routed_outputs(_compute(own), ep_x, experts, dist.group.WORLD)
    (out * coeff).sum().backward()
    return [
        torch.equal(out.view(torch.int32), ref.view(torch.int32)),  # bit patterns: -0.0 is not +0.0
        bool((out.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()),  # the case arose
        torch.equal(ep_x.grad, ref_x.grad),
    ]


def _exchange_worker() -> list[list[bool]]:
    dist.init_process_group("gloo")
    x, experts = _tokens(dist.get_rank())
    # Then every token routed to experts 2 and 3 only: rank 0's experts get nothing, yet its backward
    # must still take part in the exchange's collectives (else rank 1 waits for ever).
    return [_exchange(x, experts), _exchange(x.neg(), torch.tensor([[2, 3]]).expand(x.shape[0], K))]


def test_ep_exchange_is_exact() -> None:
    assert spawn(_exchange_worker, 2, timeout=120) == [[True, True, True]] * 2


# --- parity and grad_norm at the EP layouts (multi-process) ---------------------------------------------
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    # 8 prompts of lengths 80, 77, ..., 59, 32 new tokens each (256 scored tokens, served 4 at a time, so
    # batch composition changes as requests finish and join); fp32 and bf16; contract and plain kernels.
    return harness.checkpoints_and_rollouts(
        tmp_path_factory.mktemp("moe"), moe_tiny(), 11, 8, 80, NEW_TOKENS, TEMPERATURE
    )


ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.5, -0.25, 0.75, -0.75]


def _ppo_job(layout: Layout, checkpoints: dict, ros: dict, samples: int = 8) -> dict:
    ro = ros[("float32", "exact")]
    return dict(
        layout=layout,
        dtype="float32",
        contract="exact",
        checkpoint=checkpoints["float32"],
        rollout={k: v[:samples] for k, v in ro.items()},
        temperature=TEMPERATURE,
        advantages=ADVANTAGES[:samples],
    )


UNEVEN = 7  # over dp2: shares of 4 and 3, so one EP rank runs a filler microbatch to stay in the exchanges


def _check_parity(results: list[dict]) -> None:
    for r in results:
        label = f"{r['layout']} {r['dtype']} {r['contract']} ({r['spec']} spec)"
        assert r["tokens"] == 8 * NEW_TOKENS, label
        assert r["export_equal"] is True, label  # Megatron (EP-sharded) -> HF reproduces the checkpoint
        if r["contract"] == "exact":
            assert r["equal"] == 1.0 and r["max_abs_diff"] == 0.0 and all(r["ranks_equal"]), label
        else:  # rounding noise, not a bug: a broken stock MoE would not pass this
            eps = 0.05 if r["dtype"] == "bfloat16" else 1e-4
            assert r["equal"] == 0.0 and r["mismatched"] > 0 and 0 < r["max_abs_diff"] < eps, label


@pytest.mark.slow
def test_moe_parity_and_grad_norm(rollouts: tuple[dict, dict]) -> None:
    checkpoints, ros = rollouts
    tp1, tp1_uneven = spawn(
        harness.ppo_worker, 1, [_ppo_job(Layout(), checkpoints, ros), _ppo_job(Layout(), checkpoints, ros, UNEVEN)]
    )[0:2]
    results = []
    for world, layouts in (
        (2, [Layout(), Layout(dp=2, ep=2)]),
        (4, [Layout(tp=2, dp=2, ep=2), Layout(pp=2, dp=2, ep=2)]),
    ):
        jobs = harness.layout_jobs(layouts, checkpoints, ros, TEMPERATURE)
        steps_here = [_ppo_job(lay, checkpoints, ros) for lay in layouts if lay.ep > 1]
        if world == 2:
            steps_here.append(_ppo_job(Layout(dp=2, ep=2), checkpoints, ros, UNEVEN))
        results += spawn(harness.jobs_worker, world, jobs + steps_here)
    parity = [r for r in results if "grad_norm" not in r]
    steps = [r for r in results if "grad_norm" in r]
    assert len(parity) == 16 and len(steps) == 4
    _check_parity(parity)
    assert tp1["old_vs_rollout"]["equal"] == 1.0 and tp1_uneven["old_vs_rollout"]["equal"] == 1.0
    for r in steps:
        ref = tp1_uneven if len(r["new_logprobs"]) == UNEVEN else tp1
        assert r["old_vs_rollout"]["equal"] == 1.0, r["layout"]
        rel = abs(r["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        assert rel < 5e-6, (str(r["layout"]), len(r["new_logprobs"]), r["grad_norm"], ref["grad_norm"])
    # the uneven step really ran a filler on the short replica (its loss weight 0 keeps it out of the grads)
    uneven = next(r for r in steps if len(r["new_logprobs"]) == UNEVEN)
    assert sorted(len(s) for s in uneven["shares"][:2]) == [3, 4], uneven["shares"]
    if os.environ.get("TONPOLICY_MOE_REPORT"):  # the numbers, for a report
        Path(os.environ["TONPOLICY_MOE_REPORT"]).write_text(
            repr(
                [(str(r["layout"]), r["dtype"], r["contract"], r["mismatched"], r["max_abs_diff"]) for r in parity]
                + [(str(r["layout"]), r["grad_norm"], tp1["grad_norm"]) for r in steps]
            )
        )
