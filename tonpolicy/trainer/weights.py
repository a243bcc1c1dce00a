"""Hugging Face Qwen3 <-> megatron-core GPTModel weight conversion, for any TP/PP rank.

Megatron's layout: QKV fused per query group ([q heads of the group; k; v] for each group, groups
split across TP), gate/up fused per TP rank ([gate shard; up shard]), embedding/LM head padded to the
TP-independent padded vocab and split by rows, row-parallel weights split by columns, norms replicated.
"""

from __future__ import annotations

import torch

from tonpolicy.config.model import ModelConfig, pipeline_stage_layers

Shards = dict[tuple[int, int], dict[str, torch.Tensor]]  # (tp_rank, pp_rank) -> megatron state dict


def _layer_range(cfg: ModelConfig, pp_rank: int, pp: int, pp_layers: tuple[int, ...] | None = None) -> range:
    stages = pipeline_stage_layers(cfg.num_layers, pp, pp_layers)
    start = sum(stages[:pp_rank])
    return range(start, start + stages[pp_rank])


def _fuse_qkv(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    d, g = cfg.head_dim, cfg.num_kv_heads
    per = cfg.num_attention_heads // g
    q = q.view(g, per * d, -1)
    k = k.view(g, d, -1)
    v = v.view(g, d, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


def _split_qkv(cfg: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, g = cfg.head_dim, cfg.num_kv_heads
    per = cfg.num_attention_heads // g
    x = qkv.view(g, (per + 2) * d, -1)
    q, k, v = x.split([per * d, d, d], dim=1)
    hidden = qkv.shape[-1]
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])]) if rows > w.shape[0] else w


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tp_rank: int,
    tp: int,
    pp_rank: int,
    pp: int,
    padded_vocab: int,
    pp_layers: tuple[int, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """The GPTModel state dict (megatron names, local layer numbering) of one (tp_rank, pp_rank)."""
    if cfg.num_kv_heads % tp or cfg.intermediate_size % tp or padded_vocab % tp:
        raise ValueError(f"tp={tp} does not divide the query groups / ffn / padded vocab")

    def col(w: torch.Tensor) -> torch.Tensor:  # split output rows
        return w.chunk(tp, dim=0)[tp_rank].clone()

    def row(w: torch.Tensor) -> torch.Tensor:  # split input columns
        return w.chunk(tp, dim=1)[tp_rank].clone()

    out: dict[str, torch.Tensor] = {}
    embed = _pad_rows(hf["model.embed_tokens.weight"], padded_vocab)
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = col(embed)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not cfg.tie_word_embeddings:
            out["output_layer.weight"] = col(_pad_rows(hf["lm_head.weight"], padded_vocab))
        elif pp > 1:  # the last stage holds its own copy of the tied embedding
            out["output_layer.weight"] = col(embed)
    layers = _layer_range(cfg, pp_rank, pp, pp_layers)
    for local, i in enumerate(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        a = h + "self_attn."
        qkv = _fuse_qkv(cfg, hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"])
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out.update(
            {
                m + "input_layernorm.weight": hf[h + "input_layernorm.weight"].clone(),
                m + "self_attention.linear_qkv.weight": col(qkv),  # groups are contiguous: rows split by group
                m + "self_attention.q_layernorm.weight": hf[a + "q_norm.weight"].clone(),
                m + "self_attention.k_layernorm.weight": hf[a + "k_norm.weight"].clone(),
                m + "self_attention.linear_proj.weight": row(hf[a + "o_proj.weight"]),
                m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"].clone(),
                m + "mlp.linear_fc1.weight": torch.cat([col(gate), col(up)]),
                m + "mlp.linear_fc2.weight": row(hf[h + "mlp.down_proj.weight"]),
            }
        )
    return out


def megatron_to_hf(
    shards: Shards, cfg: ModelConfig, tp: int, pp: int, pp_layers: tuple[int, ...] | None = None
) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`: merge every rank's state dict into HF names (vocab unpadded)."""
    v = cfg.vocab_size

    def cat0(name: str, pp_rank: int) -> torch.Tensor:
        return torch.cat([shards[(t, pp_rank)][name] for t in range(tp)], dim=0)

    def cat1(name: str, pp_rank: int) -> torch.Tensor:
        return torch.cat([shards[(t, pp_rank)][name] for t in range(tp)], dim=1)

    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": cat0("embedding.word_embeddings.weight", 0)[:v]}
    hf["model.norm.weight"] = shards[(0, pp - 1)]["decoder.final_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        hf["lm_head.weight"] = cat0("output_layer.weight", pp - 1)[:v]
    for pp_rank in range(pp):
        for local, i in enumerate(_layer_range(cfg, pp_rank, pp, pp_layers)):
            h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
            q, k, vv = _split_qkv(cfg, cat0(m + "self_attention.linear_qkv.weight", pp_rank))
            fc1 = [shards[(t, pp_rank)][m + "mlp.linear_fc1.weight"].chunk(2) for t in range(tp)]
            first = shards[(0, pp_rank)]
            hf.update(
                {
                    h + "input_layernorm.weight": first[m + "input_layernorm.weight"],
                    h + "self_attn.q_proj.weight": q,
                    h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": vv,
                    h + "self_attn.q_norm.weight": first[m + "self_attention.q_layernorm.weight"],
                    h + "self_attn.k_norm.weight": first[m + "self_attention.k_layernorm.weight"],
                    h + "self_attn.o_proj.weight": cat1(m + "self_attention.linear_proj.weight", pp_rank),
                    h + "post_attention_layernorm.weight": first[m + "pre_mlp_layernorm.weight"],
                    h + "mlp.gate_proj.weight": torch.cat([g for g, _ in fc1]),
                    h + "mlp.up_proj.weight": torch.cat([u for _, u in fc1]),
                    h + "mlp.down_proj.weight": cat1(m + "mlp.linear_fc2.weight", pp_rank),
                }
            )
    return hf


def load_into(
    model: torch.nn.Module,
    hf: dict[str, torch.Tensor],
    cfg: ModelConfig,
    padded_vocab: int,
    pp_layers: tuple[int, ...] | None = None,
) -> None:
    """Load an HF state dict into this rank's GPTModel (strict: every parameter must be covered)."""
    from megatron.core import parallel_state as ps

    sd = hf_to_megatron(
        hf,
        cfg,
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        padded_vocab,
        pp_layers,
    )
    own = model.state_dict()
    sd = {k: t.to(own[k].dtype) for k, t in sd.items()}
    extra = {k: own[k] for k in own if k.endswith("_extra_state")}
    model.load_state_dict({**sd, **extra}, strict=True)
