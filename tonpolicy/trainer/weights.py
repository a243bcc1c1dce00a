"""Hugging Face Qwen3 <-> megatron-core GPTModel weight conversion, for any TP/PP rank.

Megatron's layout: QKV fused per query group ([q heads of the group; k; v] for each group, groups
split across TP), gate/up fused per TP rank ([gate shard; up shard]), embedding/LM head padded to the
TP-independent padded vocab and split by rows, row-parallel weights split by columns, norms replicated.
A Qwen3-MoE routed layer's router and experts (expert parallelism) are `moe_weights`'.
"""

from __future__ import annotations

import torch

from tonpolicy.config.hf_qwen3 import EMBED, FINAL_NORM, LM_HEAD, SHARD_DIM, layer_param, tp_kind
from tonpolicy.config.model import ModelConfig, pipeline_stage_layers
from tonpolicy.trainer import moe_weights

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


# HF layer parameter -> megatron layer parameter, for those that map one to one (the HF names and
# each one's TP split are the adapter's, tonpolicy.config.hf_qwen3).
DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
DENSE_MLP = ("mlp.down_proj.weight",)  # of DIRECT: a routed layer has none
# Fused: megatron parameter <- the HF column-parallel weights it concatenates.
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
LINEAR_QKV, LINEAR_FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])]) if rows > w.shape[0] else w


def _dim(name: str) -> int | None:
    return SHARD_DIM[tp_kind(name)]


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tp_rank: int,
    tp: int,
    pp_rank: int,
    pp: int,
    padded_vocab: int,
    pp_layers: tuple[int, ...] | None = None,
    ep_rank: int = 0,
    ep: int = 1,
    etp_rank: int | None = None,
    etp: int | None = None,
) -> dict[str, torch.Tensor]:
    """The GPTModel state dict (megatron names, local layer numbering) of one (tp_rank, pp_rank), and for
    a MoE model of its (expert-TP, EP) rank (expert TP defaults to TP)."""
    etp_rank, etp = (tp_rank if etp_rank is None else etp_rank), (tp if etp is None else etp)
    if cfg.num_kv_heads % tp or cfg.intermediate_size % tp or padded_vocab % tp:
        raise ValueError(f"tp={tp} does not divide the query groups / ffn / padded vocab")

    def shard(w: torch.Tensor, name: str) -> torch.Tensor:  # this rank's slice, by the adapter's TP plan
        dim = _dim(name)
        return w.clone() if dim is None else w.chunk(tp, dim=dim)[tp_rank].clone()

    out: dict[str, torch.Tensor] = {}
    embed = _pad_rows(hf[EMBED], padded_vocab)
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(embed, EMBED)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = shard(hf[FINAL_NORM], FINAL_NORM)
        if not cfg.tie_word_embeddings:
            out["output_layer.weight"] = shard(_pad_rows(hf[LM_HEAD], padded_vocab), LM_HEAD)
        elif pp > 1:  # the last stage holds its own copy of the tied embedding
            out["output_layer.weight"] = shard(embed, EMBED)
    for local, i in enumerate(_layer_range(cfg, pp_rank, pp, pp_layers)):
        m = f"decoder.layers.{local}."
        routed = cfg.is_moe_layer(i)
        direct = {h: meg for h, meg in DIRECT.items() if not (routed and h in DENSE_MLP)}
        names = {h: layer_param(i, h) for h in (*DIRECT, *QKV, *GATE_UP)}
        out.update({m + meg: shard(hf[names[h]], names[h]) for h, meg in direct.items()})
        qkv = _fuse_qkv(cfg, *(hf[names[h]] for h in QKV))
        out[m + LINEAR_QKV] = shard(qkv, names[QKV[0]])  # groups are contiguous: rows split by group
        if routed:
            moe = moe_weights.to_megatron(hf, cfg, i, etp_rank, etp, ep_rank, ep)
            out.update({m + k: v for k, v in moe.items()})
        else:
            out[m + LINEAR_FC1] = torch.cat([shard(hf[names[h]], names[h]) for h in GATE_UP])  # [gate; up] per rank
    return out


def megatron_to_hf(
    shards: Shards,
    cfg: ModelConfig,
    tp: int,
    pp: int,
    pp_layers: tuple[int, ...] | None = None,
    experts: moe_weights.ExpertShards | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`: merge every rank's state dict into HF names (vocab unpadded).
    `experts[(etp_rank, ep_rank, pp_rank)]`: a MoE model's expert parameters (default: in `shards`,
    at EP 1 with expert TP = TP)."""
    if experts is None:
        experts = {(t, 0, p): sd for (t, p), sd in shards.items()}

    def merge(meg: str, pp_rank: int, name: str) -> torch.Tensor:  # by the adapter's TP plan
        dim = _dim(name)
        if dim is None:
            return shards[(0, pp_rank)][meg]
        return torch.cat([shards[(t, pp_rank)][meg] for t in range(tp)], dim=dim)

    v = cfg.vocab_size
    hf: dict[str, torch.Tensor] = {EMBED: merge("embedding.word_embeddings.weight", 0, EMBED)[:v]}
    hf[FINAL_NORM] = merge("decoder.final_layernorm.weight", pp - 1, FINAL_NORM)
    if not cfg.tie_word_embeddings:
        hf[LM_HEAD] = merge("output_layer.weight", pp - 1, LM_HEAD)[:v]
    for pp_rank in range(pp):
        for local, i in enumerate(_layer_range(cfg, pp_rank, pp, pp_layers)):
            m = f"decoder.layers.{local}."
            routed = cfg.is_moe_layer(i)
            direct = {h: meg for h, meg in DIRECT.items() if not (routed and h in DENSE_MLP)}
            names = {h: layer_param(i, h) for h in (*DIRECT, *QKV, *GATE_UP)}
            hf.update({names[h]: merge(m + meg, pp_rank, names[h]) for h, meg in direct.items()})
            qkv = _split_qkv(cfg, merge(m + LINEAR_QKV, pp_rank, names[QKV[0]]))
            hf.update({names[h]: w for h, w in zip(QKV, qkv, strict=True)})
            if routed:
                stage = {(t, r): sd for (t, r, p), sd in experts.items() if p == pp_rank}
                router = shards[(0, pp_rank)][m + moe_weights.ROUTER_MEG]
                hf.update(moe_weights.to_hf(router, stage, cfg, i, m))
                continue
            fc1 = [shards[(t, pp_rank)][m + LINEAR_FC1].chunk(2) for t in range(tp)]  # [gate; up] per rank
            for h, parts in zip(GATE_UP, zip(*fc1, strict=True), strict=True):
                hf[names[h]] = torch.cat(parts, dim=_dim(names[h]))
    return hf


def megatron_state(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int, pp_layers: tuple[int, ...] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's Megatron-named slices of HF-named tensors (weights, or anything of their shapes)."""
    from megatron.core import parallel_state as ps

    return hf_to_megatron(
        hf,
        cfg,
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        padded_vocab,
        pp_layers,
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
    )


def load_into(
    model: torch.nn.Module,
    hf: dict[str, torch.Tensor],
    cfg: ModelConfig,
    padded_vocab: int,
    pp_layers: tuple[int, ...] | None = None,
) -> None:
    """Load an HF state dict into this rank's GPTModel (strict: every parameter must be covered)."""
    sd = megatron_state(hf, cfg, padded_vocab, pp_layers)
    own = model.state_dict()
    sd = {k: t.to(own[k].dtype) for k, t in sd.items()}
    extra = {k: own[k] for k in own if k.endswith("_extra_state")}
    model.load_state_dict({**sd, **extra}, strict=True)
