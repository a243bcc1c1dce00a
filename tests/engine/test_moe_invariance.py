"""Qwen3-MoE under the contract: a token's expert set, routing weights and logits bits do not depend on
the batch it rides in (other sequences, chunked prefill of any size, decode rows, padding, concurrency).
Negative controls: the plain kernels' MoE breaks it, and `torch.topk` picks another expert than the
contract's stable rule on tied logits."""

from __future__ import annotations

import random

import pytest
import torch
from support.kernel_utils import DTYPES

from tonpolicy.config.compose import compose_config
from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.moe import contract_route, plain_route
from tonpolicy.model import KVPool, Segment
from tonpolicy.model.qwen3_moe import Qwen3Moe
from tonpolicy.rollout.engine import Engine, GenRequest

CFG = compose_config(["model=qwen3_moe_tiny"]).model


def _model(kernels: str, dtype: torch.dtype) -> Qwen3Moe:
    return Qwen3Moe(CFG, get_kernels(kernels), dtype)


def _segment_batches(m: Qwen3Moe, seqs: list[torch.Tensor], seed: int) -> tuple[list, list]:
    """Feed `seqs` as random mixes of chunked prefill and decode rows of all sequences; per sequence,
    the logits rows and routes (per MoE layer: experts, weights) gathered back in token order."""
    rng = random.Random(seed)
    kern, cfg = m.kernels, m.cfg
    pool = KVPool(
        cfg.num_layers,
        len(seqs),
        96,
        cfg.num_kv_heads,
        cfg.head_dim,
        kern.kv_cache_dtype(m.dtype),
        kern.attention_tile,
        layout=kern.kv_pool_layout,
    )
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    routes: list[dict[int, list]] = [{} for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        ids, segs, owners = [], [], []
        for i, s in enumerate(seqs):
            if done[i] >= len(s) or rng.random() < 0.2:
                continue
            take = min(1 if done[i] and rng.random() < 0.5 else rng.randrange(1, 30), len(s) - done[i])
            segs.append(Segment(take, start=done[i], slot=i))
            ids.append(s[done[i] : done[i] + take])
            owners += [i] * take
            done[i] += take
        if not segs:
            continue
        m.routes = {}
        n = sum(len(x) for x in ids)
        out = m.forward_segments(torch.cat(ids), segs, pool, torch.arange(n))
        step, m.routes = m.routes, None
        owner = torch.tensor(owners)
        for i in set(owners):
            rows = (owner == i).nonzero().flatten()
            logits[i].append(out[rows])
            for li, r in step.items():
                routes[i].setdefault(li, []).append((r.experts[rows], r.weights[rows]))
    cat_routes = [
        {li: (torch.cat([e for e, _ in v]), torch.cat([w for _, w in v])) for li, v in r.items()} for r in routes
    ]
    return [torch.cat(x) for x in logits], cat_routes


def _seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g) for n in (45, 70, 13)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_routes_weights_and_logits_batch_invariant(dtype):
    m = _model("ordered", dtype)
    seqs = _seqs()
    refs = []
    for s in seqs:
        m.routes = {}
        logits = m(s)
        refs.append((logits, {li: (r.experts, r.weights) for li, r in m.routes.items()}))
        m.routes = None
    assert sorted(refs[0][1]) == [0, 1, 3]  # layer 2 is dense (mlp_only_layers)
    for seed in (0, 1):
        logits, routes = _segment_batches(m, seqs, seed)
        for (ref_logits, ref_routes), got_logits, got_routes in zip(refs, logits, routes, strict=True):
            assert torch.equal(got_logits, ref_logits)
            for li, (experts, weights) in ref_routes.items():
                assert torch.equal(got_routes[li][0], experts)
                assert torch.equal(got_routes[li][1], weights)


def test_plain_moe_is_not_batch_invariant():
    """Negative control: the plain kernels' MoE (torch.topk, bf16 products summed in bf16, library
    GEMMs) gives a token other bits when other tokens share its forward."""
    bad, max_diff = 0, 0.0
    for dtype in DTYPES:
        m = _model("plain", dtype)
        seqs = _seqs()
        refs = [m(s) for s in seqs]
        logits, _ = _segment_batches(m, seqs, 0)
        for r, g in zip(refs, logits, strict=True):
            bad += int(not torch.equal(r, g))
            max_diff = max(max_diff, (r - g).abs().max().item())
    assert bad > 0 and 0 < max_diff < 0.1, (bad, max_diff)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_concurrency_and_chunking_do_not_move_bits(dtype):
    """The embedded engine: each token's logprob bits are the same served alone, 4 at a time with
    chunked prefill of 16, and all at once."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (30, 9, 21, 40, 17)]
    runs = []
    for running, chunk in ((1, None), (4, 16), (5, 7)):
        engine = Engine(_model("ordered", dtype), max_running_requests=running, chunked_prefill_size=chunk)
        res = engine.generate([GenRequest(p, 12, temperature=0.9, seed=i) for i, p in enumerate(prompts)])
        runs.append([(r.output_ids, r.output_logprobs) for r in res])
    assert all(len(ids) == 12 for ids, _ in runs[0])
    for other in runs[1:]:
        for (ids_a, lp_a), (ids_b, lp_b) in zip(runs[0], other, strict=True):
            assert ids_a == ids_b
            assert torch.equal(torch.as_tensor(lp_a), torch.as_tensor(lp_b))


def test_stable_topk_against_torch_topk():
    """The contract's top-k: descending logit, the lower expert id on a tie, the same for a row alone or
    in any batch. Negative control: at Qwen3-30B-A3B's routing (128 experts, top-8), bf16 router logits
    tie at the 8th place on ~6% of rows and torch.topk picks another expert than the stable rule on
    about half of those; fp32 logits do not tie there."""
    g = torch.Generator().manual_seed(0)
    bf16 = torch.randn(4096, 128, generator=g).to(torch.bfloat16).float()
    mine = contract_route(bf16, 8, True).experts
    rows = bf16[:512].tolist()
    ranked = torch.tensor([sorted(range(128), key=lambda e, r=r: (-r[e], e))[:8] for r in rows])
    assert torch.equal(mine[:512], ranked.sort(dim=-1).values)  # the rule, row by row
    assert torch.equal(contract_route(bf16[17:18], 8, True).experts, mine[17:18])
    kth, next_ = bf16.sort(dim=-1, descending=True).values[:, 7:9].unbind(-1)
    assert (kth == next_).float().mean() > 0.02
    differ = (plain_route(bf16, 8, True).experts != mine).any(-1).float().mean()
    assert 0.005 < differ < 0.1, differ
    fp32 = torch.randn(4096, 128, generator=g)
    kth, next_ = fp32.sort(dim=-1, descending=True).values[:, 7:9].unbind(-1)
    assert (kth == next_).sum() == 0


def test_routing_weights_rule():
    """norm_topk_prob: the fp32 softmax over the k selected logits; else the softmax over all at the k."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    r = contract_route(logits, 2, True)
    assert r.experts.tolist() == [[1, 3]]
    assert torch.allclose(r.weights, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))
    r = contract_route(logits, 2, False)
    assert torch.allclose(r.weights, torch.softmax(logits, -1)[:, [1, 3]])


def test_engine_reports_each_fed_positions_routes():
    """return_routed_experts: positions [0, prompt + output - 1), per layer the token's experts (-1 in
    the dense layer), equal to a full forward of the whole sequence, whatever the concurrency; through
    the wire in SGLang's encoding (base64 int32 [positions, layers, top_k])."""
    from tonpolicy.rollout.wire.request import parse_generate_request
    from tonpolicy.rollout.wire.response import build_generate_output, decode_routed_experts, parse_generate_output

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (20, 7, 33)]
    m = _model("ordered", torch.float32)
    tables = []
    for running in (1, 3):
        engine = Engine(m, max_running_requests=running, chunked_prefill_size=9)
        reqs = [GenRequest(p, 6, temperature=0.9, seed=i, return_routed_experts=True) for i, p in enumerate(prompts)]
        tables.append([(r.output_ids, r.routed_experts) for r in engine.generate(reqs)])
    for (ids, table), (ids2, table2), prompt in zip(tables[0], tables[1], prompts, strict=True):
        assert ids == ids2 and torch.equal(table, table2)
        assert table.shape == (len(prompt) + len(ids) - 1, CFG.num_layers, CFG.num_experts_per_tok)
        m.routes = {}
        m(torch.tensor(prompt + ids[:-1]))
        for li in range(CFG.num_layers):
            want = m.routes[li].experts.to(torch.int32) if li in m.routes else torch.full_like(table[:, li], -1)
            assert torch.equal(table[:, li], want), li
        m.routes = None
    item = parse_generate_request(
        {"input_ids": prompts[0], "return_routed_experts": True, "routed_experts_start_len": 5}
    ).items[0]
    ids, table = tables[0][0]
    from tonpolicy.rollout.engine.generation import GenResult

    out = build_generate_output("r", item, GenResult(ids, torch.zeros(len(ids)), "length", routed_experts=table), "1")
    got = decode_routed_experts(
        parse_generate_output(
            {**out, "meta_info": {**out["meta_info"], "output_token_logprobs": [[0.0, t, None] for t in ids]}}
        )["routed_experts"],
        CFG.num_layers,
        CFG.num_experts_per_tok,
    )
    assert got == table[5:].tolist()
    with pytest.raises(ValueError, match="dense"):
        from tonpolicy.config.model import ModelConfig
        from tonpolicy.model import Qwen3

        Engine(Qwen3(ModelConfig(), get_kernels("ordered"), torch.float32), max_running_requests=1).check(
            GenRequest([1, 2], 2, return_routed_experts=True)
        )
