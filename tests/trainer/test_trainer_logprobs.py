"""The logprob recipe's TP gather: Megatron's reduce-scatter backward inflates grad_norm ~TP x at TP=2;
the narrowing backward of `replicated_all_gather` (trainer/comm.py) matches TP=1. Real GPTModel, 2 processes."""

from __future__ import annotations

import torch
from support.trainer_common import grad_norm, random_hf

from tonpolicy.config.model import ModelConfig
from tonpolicy.trainer.process_groups import Layout, spawn


def _loss_grad_norm(cfg: ModelConfig, hf: dict, stock_gather: bool) -> tuple[float, torch.Tensor]:
    from tonpolicy.kernels import padded_vocab_size
    from tonpolicy.trainer.logprobs import token_logprobs
    from tonpolicy.trainer.model import build_gpt
    from tonpolicy.trainer.weights import load_into

    model = build_gpt(cfg, torch.float32, "stock", "ulysses", None, canonical_shards=4)
    load_into(model, hf, cfg, padded_vocab_size(cfg.vocab_size, 4))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (1, 24), generator=g)
    logits = model(ids, torch.arange(24)[None], None)
    lp = token_logprobs(logits, targets, cfg.vocab_size, 0.8, stock_gather=stock_gather)
    (-lp.mean()).backward()
    return grad_norm(model), lp.detach()


def _worker() -> dict[str, float]:
    from tonpolicy.trainer.process_groups import init_distributed, reset_model_parallel

    cfg = ModelConfig()
    hf = random_hf(cfg, seed=3)
    init_distributed(Layout(tp=1))  # DP=2: every rank computes the TP=1 reference
    ref_norm, ref_lp = _loss_grad_norm(cfg, hf, stock_gather=False)
    reset_model_parallel()
    init_distributed(Layout(tp=2))
    stock_norm, stock_lp = _loss_grad_norm(cfg, hf, stock_gather=True)
    narrow_norm, narrow_lp = _loss_grad_norm(cfg, hf, stock_gather=False)
    return {
        "tp1": ref_norm,
        "tp2_stock": stock_norm,
        "tp2_narrow": narrow_norm,
        "lp_equal_stock_narrow": float(torch.equal(stock_lp, narrow_lp)),
        "lp_max_diff_tp1": float((narrow_lp - ref_lp).abs().max()),
    }


def test_stock_gather_inflates_grad_norm_and_narrow_matches_tp1() -> None:
    r = spawn(_worker, 2)
    print(r)
    assert r["lp_equal_stock_narrow"] == 1.0  # same forward; only the backward differs
    assert r["lp_max_diff_tp1"] < 1e-5
    ratio = r["tp2_stock"] / r["tp1"]
    assert 1.9 < ratio < 2.1, ratio  # the bug: ~TP x
    assert abs(r["tp2_narrow"] / r["tp1"] - 1.0) < 1e-5
