"""HF Qwen3 <-> Megatron weight conversion: round trip at every TP/PP rank split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.trainer.weights import hf_to_megatron, megatron_to_hf


def _random_hf(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    H, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, H), "model.norm.weight": r(H)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = r(cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
            p + "self_attn.q_proj.weight": r(cfg.q_size, H), p + "self_attn.k_proj.weight": r(cfg.kv_size, H),
            p + "self_attn.v_proj.weight": r(cfg.kv_size, H), p + "self_attn.o_proj.weight": r(H, cfg.q_size),
            p + "self_attn.q_norm.weight": r(D), p + "self_attn.k_norm.weight": r(D),
            p + "mlp.gate_proj.weight": r(F, H), p + "mlp.up_proj.weight": r(F, H),
            p + "mlp.down_proj.weight": r(H, F),
        })
    return sd


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 4)])
def test_round_trip(tp: int, pp: int, tied: bool) -> None:
    cfg = dataclasses.replace(ModelConfig(), tie_word_embeddings=tied)
    hf = _random_hf(cfg)
    shards = {(t, p): hf_to_megatron(hf, cfg, t, tp, p, pp, 2048) for t in range(tp) for p in range(pp)}
    back = megatron_to_hf(shards, cfg, tp, pp)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_is_fused_per_query_group() -> None:
    cfg = ModelConfig()
    hf = _random_hf(cfg)
    sd = hf_to_megatron(hf, cfg, 1, 2, 0, 1, 2048)  # TP rank 1 of 2: query groups 2 and 3
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per = cfg.head_dim, cfg.num_attention_heads // cfg.num_kv_heads
    block = (per + 2) * d
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    assert qkv.shape == (2 * block, cfg.hidden_size)
    assert torch.equal(qkv[:per * d], q[2 * per * d:3 * per * d])  # group 2's query heads
    assert torch.equal(qkv[per * d:(per + 1) * d], k[2 * d:3 * d])  # then group 2's key head
    emb = sd["embedding.word_embeddings.weight"]
    assert emb.shape == (1024, cfg.hidden_size) and torch.equal(emb[:1024 - (2048 - cfg.vocab_size)],
                                                                   hf["model.embed_tokens.weight"][1024:])
    assert not emb[1024 - (2048 - cfg.vocab_size):].any()  # vocab padding rows are zero
