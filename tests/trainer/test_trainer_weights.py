"""HF Qwen3 <-> Megatron weight conversion: round trip at every TP/PP rank split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.trainer_common import random_hf

from tonpolicy.config.model import ModelConfig
from tonpolicy.trainer.weights import hf_to_megatron, megatron_to_hf


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 4)])
def test_round_trip(tp: int, pp: int, tied: bool) -> None:
    cfg = dataclasses.replace(ModelConfig(), tie_word_embeddings=tied)
    hf = random_hf(cfg)
    shards = {(t, p): hf_to_megatron(hf, cfg, t, tp, p, pp, 2048) for t in range(tp) for p in range(pp)}
    back = megatron_to_hf(shards, cfg, tp, pp)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_is_fused_per_query_group() -> None:
    cfg = ModelConfig()
    hf = random_hf(cfg)
    sd = hf_to_megatron(hf, cfg, 1, 2, 0, 1, 2048)  # TP rank 1 of 2: query groups 2 and 3
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per = cfg.head_dim, cfg.num_attention_heads // cfg.num_kv_heads
    block = (per + 2) * d
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    assert qkv.shape == (2 * block, cfg.hidden_size)
    assert torch.equal(qkv[: per * d], q[2 * per * d : 3 * per * d])  # group 2's query heads
    assert torch.equal(qkv[per * d : (per + 1) * d], k[2 * d : 3 * d])  # then group 2's key head
    emb = sd["embedding.word_embeddings.weight"]
    assert emb.shape == (1024, cfg.hidden_size) and torch.equal(
        emb[: 1024 - (2048 - cfg.vocab_size)], hf["model.embed_tokens.weight"][1024:]
    )
    assert not emb[1024 - (2048 - cfg.vocab_size) :].any()  # vocab padding rows are zero
