"""The Hugging Face adapter of the Qwen3-MoE family (`Qwen3MoeForCausalLM`): config.json <->
ModelConfig with transformers' Qwen3MoeConfig defaults, the parameter names (per-expert
`mlp.experts.{e}.{gate,up,down}_proj` and the router `mlp.gate`, as the published checkpoints store
them) and the tensor-parallel plan. Everything Qwen3 dense shares (attention, norms, embeddings) is
`hf_qwen3`'s; this module adds only what experts change. Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from tonpolicy.config import hf_qwen3 as dense
from tonpolicy.config.hf_qwen3 import (  # noqa: F401  (the adapter interface, shared with dense)
    COLUMN,
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    REPLICATED,
    ROW,
    SHARD_DIM,
    VOCAB,
    HFParam,
    layer_param,
)
from tonpolicy.config.model import MOE_FIELDS as MOE_ARCHITECTURE_FIELDS
from tonpolicy.config.model import ModelConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"

# The MoE fields keep config.json's published names.
MOE_FIELDS: dict[str, str] = {f: f for f in MOE_ARCHITECTURE_FIELDS}
HF_KEYS: dict[str, str] = {**dense.HF_KEYS, **MOE_FIELDS}
# transformers' Qwen3MoeConfig defaults (models/qwen3_moe/configuration_qwen3_moe.py); an absent
# head_dim is hidden_size // num_attention_heads there (resolved in hf_value).
HF_DEFAULTS: dict[str, Any] = {
    **dense.HF_DEFAULTS,
    "num_hidden_layers": 24,
    "hidden_size": 2048,
    "num_key_value_heads": 4,
    "head_dim": None,
    "intermediate_size": 6144,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}
# transformers >= 5 writes num_local_experts; the published checkpoints say num_experts.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


def hf_value(hf: dict[str, Any], field: str) -> Any:
    """The raw value HF reads from config.json `hf` for ModelConfig `field` (its default when absent)."""
    if field == "num_experts":
        for key in EXPERT_COUNT_KEYS:
            if key in hf:
                return hf[key]
        return HF_DEFAULTS["num_experts"]
    if field == "mlp_only_layers":
        value = hf.get("mlp_only_layers", [])
        return [] if value is None else value
    if field == "head_dim" and hf.get("head_dim") is None:
        hidden, heads = hf_value(hf, "hidden_size"), hf_value(hf, "num_attention_heads")
        return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    if field in MOE_FIELDS:
        return hf.get(field, HF_DEFAULTS[field])
    return dense.hf_value(hf, field, HF_DEFAULTS)


def hf_is_default(hf: dict[str, Any], field: str) -> bool:
    if field == "num_experts":
        return not any(k in hf for k in EXPERT_COUNT_KEYS)
    return dense.hf_is_default(hf, field) if field in dense.HF_KEYS else HF_KEYS[field] not in hf


convert = dense.convert


def unsupported(hf: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(config.json key, value, why) for every setting the Qwen3-MoE contract model does not implement."""
    dense_rules = [p for p in dense.unsupported(hf) if p[0] not in dense.MOE_KEYS]
    shared = [(k, hf[k], "shared experts are not part of Qwen3-MoE") for k in _SHARED_EXPERT_KEYS if hf.get(k)]
    both = [k for k in EXPERT_COUNT_KEYS if k in hf]
    if len(both) == 2 and hf[both[0]] != hf[both[1]]:
        shared.append(("num_local_experts", hf["num_local_experts"], f"disagrees with num_experts={hf['num_experts']}"))
    return dense_rules + shared


def config_from_hf(hf: dict[str, Any], base: ModelConfig | None = None) -> ModelConfig:
    """config.json -> ModelConfig (HF's defaults for absent keys; labels from `base`)."""
    problems = unsupported(hf)
    if problems:
        raise ValueError("; ".join(f"config.json has {k}={v!r}: {why}" for k, v, why in problems))
    values = {f: hf_value(hf, f) for f in HF_KEYS}
    if values["architecture"] is None:
        values["architecture"] = ""
    return replace(base or ModelConfig(), family=MODEL_TYPE, **{f: convert(f, v) for f, v in values.items()})


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """ModelConfig -> config.json: dense Qwen3's keys, the MoE keys under their published names and
    num_local_experts as well (what transformers >= 5 reads)."""
    out = dense.config_to_hf(cfg, dtype)
    out["model_type"] = MODEL_TYPE
    out.update({key: getattr(cfg, f) for f, key in MOE_FIELDS.items()})
    out["mlp_only_layers"] = list(cfg.mlp_only_layers)
    out["num_local_experts"] = cfg.num_experts
    out["output_router_logits"] = False
    return out


# --- parameter names and the TP plan ----------------------------------------------------------------
ROUTER = "mlp.gate.weight"
EXPERT_PROJS: dict[str, str] = {"gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_ATTENTION = {k: v for k, v in dense.LAYER_PARAMS.items() if not k.startswith("mlp.")}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def expert_param(expert: int, proj: str) -> str:
    """The layer-relative name of one expert's weight."""
    return f"mlp.experts.{expert}.{proj}.weight"


def parse_expert(suffix: str) -> tuple[int, str] | None:
    """(expert, proj) of a layer-relative expert weight name; None for any other."""
    m = _EXPERT.fullmatch(suffix)
    return (int(m.group(1)), m.group(2)) if m else None


def _layer_params(cfg: ModelConfig, layer: int) -> dict[str, HFParam]:
    h, f = cfg.hidden_size, cfg.moe_intermediate_size
    out = {s: HFParam(dense._layer_shape(cfg, s), tp) for s, tp in _ATTENTION.items()}
    if not cfg.is_moe_layer(layer):
        out.update(
            {s: HFParam(dense._layer_shape(cfg, s), tp) for s, tp in dense.LAYER_PARAMS.items() if s.startswith("mlp.")}
        )
        return out
    out[ROUTER] = HFParam((cfg.num_experts, h), REPLICATED)
    for e in range(cfg.num_experts):
        for proj, tp in EXPERT_PROJS.items():
            out[expert_param(e, proj)] = HFParam((h, f) if proj == "down_proj" else (f, h), tp)
    return out


def hf_params(cfg: ModelConfig) -> dict[str, HFParam]:
    """Every HF parameter of the model, in a fixed order (forward order within a layer, experts in
    ascending id), with its shape and TP kind (an expert's TP kind is within its expert-TP group)."""
    out = {EMBED: HFParam((cfg.vocab_size, cfg.hidden_size), VOCAB)}
    for i in range(cfg.num_layers):
        out.update({layer_param(i, s): p for s, p in _layer_params(cfg, i).items()})
    out[FINAL_NORM] = HFParam((cfg.hidden_size,), REPLICATED)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = HFParam((cfg.vocab_size, cfg.hidden_size), VOCAB)
    return out


def parse_layer_param(name: str) -> tuple[int, str] | None:
    """(layer, suffix) of a decoder-layer parameter name (attention, dense MLP, router or expert)."""
    m = _LAYER.fullmatch(name)
    if not m:
        return None
    suffix = m.group(2)
    known = suffix in dense.LAYER_PARAMS or suffix == ROUTER or parse_expert(suffix) is not None
    return (int(m.group(1)), suffix) if known else None


def tp_kind(name: str) -> str:
    """The TP kind of an HF parameter name (KeyError for a name the family does not have)."""
    if name in (EMBED, LM_HEAD):
        return VOCAB
    if name == FINAL_NORM:
        return REPLICATED
    parsed = parse_layer_param(name)
    if parsed is None:
        raise KeyError(f"not a Qwen3-MoE parameter: {name}")
    suffix = parsed[1]
    if suffix == ROUTER:
        return REPLICATED
    expert = parse_expert(suffix)
    return EXPERT_PROJS[expert[1]] if expert else dense.LAYER_PARAMS[suffix]
