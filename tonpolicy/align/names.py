"""The one canonical naming of the checkpoints both engines dump, and how each engine's weights map to it.

A checkpoint is (layer, op). Per decoder layer, in computation order:

    input_norm, q, k, v, q_norm, k_norm, q_rope, k_rope, attn_out, o_proj, attn_residual,
    post_attn_norm, mlp_gate, mlp_up, mlp_act, mlp_down, residual

`attn_out` is the core attention output (the output projection's input), `attn_residual` the residual
stream after attention (the post-attention norm's input), `residual` the layer's output. Around the
layers: `embed` (layer -1) before them, `final_norm`, `logits`, `logprobs` (layer = num_layers) after.
Every tensor is stored token-major as [positions, features]: heads are flattened, logits cover the real
vocab, logprobs have one feature. Position p is the input token's index in prompt+response; the logits
and logprob at p score token p+1 (so the decode step that sampled token t sits at position t-1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.families import adapter

LAYER_OPS: tuple[str, ...] = (
    "input_norm",
    "q",
    "k",
    "v",
    "q_norm",
    "k_norm",
    "q_rope",
    "k_rope",
    "attn_out",
    "o_proj",
    "attn_residual",
    "post_attn_norm",
    "mlp_gate",
    "mlp_up",
    "mlp_act",
    "mlp_down",
    "residual",
)
PRE_OPS: tuple[str, ...] = ("embed",)
POST_OPS: tuple[str, ...] = ("final_norm", "logits", "logprobs")
ALL_OPS: tuple[str, ...] = PRE_OPS + LAYER_OPS + POST_OPS
_OP_INDEX = {op: i for i, op in enumerate(ALL_OPS)}

# Ops whose features a tensor-parallel rank holds only a column slice of (heads, FFN columns, vocab):
# the trainer's shards are concatenated over TP ranks in rank order; every other op is replicated.
TP_COLUMN_OPS = frozenset(
    {"q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attn_out", "mlp_gate", "mlp_up", "mlp_act", "logits"}
)


@dataclass(frozen=True, order=False)
class Checkpoint:
    layer: int
    op: str

    @property
    def name(self) -> str:
        if self.op in PRE_OPS or self.op in POST_OPS:
            return self.op
        return f"layers.{self.layer}.{self.op}"

    def sort_key(self) -> tuple[int, int]:
        return (self.layer, _OP_INDEX[self.op])

    def __str__(self) -> str:
        return self.name


def checkpoint(layer: int, op: str, num_layers: int) -> Checkpoint:
    """Build a checkpoint, pinning the pre/post ops to their fixed layer index."""
    if op not in _OP_INDEX:
        raise ValueError(f"unknown op {op!r} (expected one of {list(ALL_OPS)})")
    if op in PRE_OPS:
        return Checkpoint(-1, op)
    if op in POST_OPS:
        return Checkpoint(num_layers, op)
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range [0, {num_layers})")
    return Checkpoint(layer, op)


_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(\w+)$")


def parse_name(name: str, num_layers: int) -> Checkpoint:
    """Inverse of Checkpoint.name."""
    m = _LAYER_NAME.match(name)
    if m:
        return checkpoint(int(m.group(1)), m.group(2), num_layers)
    return checkpoint(0, name, num_layers)


# --- weight roles: parameter name -> (layer, role) ------------------------------------------------
# HF layer parameter (tonpolicy.config.hf_qwen3.LAYER_PARAMS) -> role.
HF_LAYER_ROLES = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attn_norm",
    "mlp.gate_proj.weight": "mlp_gate",
    "mlp.up_proj.weight": "mlp_up",
    "mlp.down_proj.weight": "mlp_down",
}
_MEGATRON_LAYER_ROLES = {
    "input_layernorm": "input_norm",
    "self_attention.linear_qkv": "qkv",
    "self_attention.q_layernorm": "q_norm",
    "self_attention.k_layernorm": "k_norm",
    "self_attention.linear_proj": "o_proj",
    "pre_mlp_layernorm": "post_attn_norm",
    "mlp.linear_fc1": "gate_up",
    "mlp.linear_fc2": "mlp_down",
}
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)\.weight$")


def hf_weight_role(name: str, cfg: ModelConfig) -> tuple[int, str] | None:
    """(layer, role) of a Hugging Face parameter (the rollout model's names, read by its family's adapter);
    None for a parameter no checkpoint op reads as its weight (a router's, an expert's)."""
    hf = adapter(cfg.family)
    layer = hf.parse_layer_param(name)
    if layer is not None:
        role = HF_LAYER_ROLES.get(layer[1])
        return None if role is None else (layer[0], role)
    if name == hf.FINAL_NORM:
        return cfg.num_layers, "final_norm"
    if name in (hf.LM_HEAD, hf.EMBED):
        return cfg.num_layers, "logits"  # the LM head reads the (tied) embedding as a weight
    return None


def megatron_weight_role(name: str, num_layers: int, layer_offset: int) -> tuple[int, str] | None:
    """(global layer, role) of a megatron GPTModel parameter; `layer_offset` maps the stage's local
    layer numbering to global layers (pipeline parallelism)."""
    m = _MEGATRON_LAYER.match(name)
    if m and m.group(2) in _MEGATRON_LAYER_ROLES:
        return int(m.group(1)) + layer_offset, _MEGATRON_LAYER_ROLES[m.group(2)]
    if name == "decoder.final_layernorm.weight":
        return num_layers, "final_norm"
    if name in ("output_layer.weight", "embedding.word_embeddings.weight"):
        return num_layers, "logits"  # tied heads pass the embedding weight to the output layer
    return None


# --- fused projections -----------------------------------------------------------------------------
def split_qkv(t: torch.Tensor, heads_per_group: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Megatron's fused QKV rows [..., groups*(per+2)*d] (per query group: its q heads, k, v) -> q, k, v
    with heads in HF order. Works on a TP rank's local groups: groups are contiguous across ranks."""
    per, d = heads_per_group, head_dim
    x = t.reshape(*t.shape[:-1], -1, (per + 2) * d)
    q, k, v = x.split([per * d, d, d], dim=-1)
    return {"q": q.flatten(-2), "k": k.flatten(-2), "v": v.flatten(-2)}


def split_gate_up(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Megatron's fused fc1 output [..., 2*F_local] = [gate shard; up shard] of this TP rank."""
    gate, up = t.chunk(2, dim=-1)
    return {"mlp_gate": gate, "mlp_up": up}
