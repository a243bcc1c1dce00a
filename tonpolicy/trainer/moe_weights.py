"""Hugging Face Qwen3-MoE <-> megatron-core weights of one routed layer, with expert parallelism.

The router `mlp.gate.weight` is `mlp.router.weight`, replicated. Expert e lives on EP rank e // (E/ep)
as local expert e % (E/ep) (megatron's SequentialMLP: `mlp.experts.local_experts.{j}`); within its
expert-TP group fc1 is [gate shard; up shard] and fc2 is split by columns, as the dense MLP is (the TP
split of each HF weight is the adapter's, tonpolicy.config.hf_qwen3_moe).
"""

from __future__ import annotations

import torch

from tonpolicy.config.hf_qwen3_moe import ROUTER, SHARD_DIM, expert_param, layer_param, tp_kind
from tonpolicy.config.model import ModelConfig

ROUTER_MEG = "mlp.router.weight"
GATE_UP = ("gate_proj", "up_proj")

# (expert-TP rank, EP rank, pp rank) -> the megatron expert parameters that rank holds
ExpertShards = dict[tuple[int, int, int], dict[str, torch.Tensor]]


def expert_names(local: int) -> tuple[str, str]:
    """Layer-relative megatron names of local expert `local`'s fc1 and fc2."""
    prefix = f"mlp.experts.local_experts.{local}."
    return prefix + "linear_fc1.weight", prefix + "linear_fc2.weight"


def is_expert_param(name: str) -> bool:
    return ".mlp.experts.local_experts." in name


def experts_per_rank(cfg: ModelConfig, ep: int) -> int:
    if cfg.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={cfg.num_experts}")
    return cfg.num_experts // ep


def _dim(name: str) -> int:
    dim = SHARD_DIM[tp_kind(name)]
    assert dim is not None, name
    return dim


def to_megatron(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, layer: int, etp_rank: int, etp: int, ep_rank: int, ep: int
) -> dict[str, torch.Tensor]:
    """Layer-relative megatron parameters of routed layer `layer` on this (expert-TP, EP) rank."""
    if cfg.moe_intermediate_size % etp:
        raise ValueError(f"expert TP={etp} does not divide moe_intermediate_size={cfg.moe_intermediate_size}")

    def shard(e: int, proj: str) -> torch.Tensor:
        name = layer_param(layer, expert_param(e, proj))
        return hf[name].chunk(etp, dim=_dim(name))[etp_rank]

    out = {ROUTER_MEG: hf[layer_param(layer, ROUTER)].clone()}
    per = experts_per_rank(cfg, ep)
    for local in range(per):
        e = ep_rank * per + local
        fc1, fc2 = expert_names(local)
        out[fc1] = torch.cat([shard(e, p) for p in GATE_UP])  # [gate shard; up shard], as the dense fc1
        out[fc2] = shard(e, "down_proj").clone()
    return out


def to_hf(
    router: torch.Tensor, experts: dict[tuple[int, int], dict[str, torch.Tensor]], cfg: ModelConfig, layer: int, m: str
) -> dict[str, torch.Tensor]:
    """Inverse of `to_megatron`: `experts[(etp_rank, ep_rank)]` is that rank's state dict (its megatron
    names under the layer prefix `m`); every expert's HF weights merged over its expert-TP group."""
    etp = 1 + max(t for t, _ in experts)
    ep = 1 + max(r for _, r in experts)
    per = experts_per_rank(cfg, ep)
    out = {layer_param(layer, ROUTER): router}
    for e in range(cfg.num_experts):
        fc1, fc2 = (m + n for n in expert_names(e % per))
        parts = [experts[(t, e // per)] for t in range(etp)]
        gate_up = [p[fc1].chunk(2) for p in parts]
        for proj, shards in zip(GATE_UP, zip(*gate_up, strict=True), strict=True):
            name = layer_param(layer, expert_param(e, proj))
            out[name] = torch.cat(shards, dim=_dim(name))
        name = layer_param(layer, expert_param(e, "down_proj"))
        out[name] = torch.cat([p[fc2] for p in parts], dim=_dim(name))
    return out
