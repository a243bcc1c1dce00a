"""The Hugging Face adapter of the Qwen3 dense family, the one source of what HF calls everything:
config.json <-> ModelConfig (with HF Qwen3Config's own defaults for absent keys), the parameter names,
and the tensor-parallel plan of every HF weight.

It sits in `config` (below `model`, `trainer`, `rollout`, `inside_sglang` and `align`) because the HF
config cross-check lives here too; it imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from tonpolicy.config.model import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"

# ModelConfig field -> config.json key.
HF_KEYS: dict[str, str] = {
    "architecture": "architectures",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
# What HF reads for an absent key: transformers' Qwen3Config field defaults (models/qwen3/
# configuration_qwen3.py) and RotaryEmbeddingConfigMixin.default_theta. Note head_dim is 128 and the KV
# heads 32 whatever the other sizes (only an explicit null num_key_value_heads means "= attention heads").
HF_DEFAULTS: dict[str, Any] = {
    "architectures": None,
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "intermediate_size": 22016,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# config.json settings the dense contract model runs in one way only (HF's defaults too): key -> value.
_FIXED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}
# config.json keys that only a mixture-of-experts model has.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    # As transformers: rope_scaling (the old name) wins over rope_parameters.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return rope if isinstance(rope, dict) else {}


def hf_value(hf: dict[str, Any], field: str, defaults: dict[str, Any] | None = None) -> Any:
    """The raw value HF reads from config.json `hf` for ModelConfig `field` (its default when absent;
    `defaults`: another family's table of HF defaults)."""
    defaults = HF_DEFAULTS if defaults is None else defaults
    key = HF_KEYS[field]
    if field == "architecture":  # the class SGLang and transformers pick: the first one listed
        archs = hf.get(key)
        return archs[0] if isinstance(archs, list) and archs else None
    if field == "rope_theta":  # transformers >= 5 moves it under rope_parameters, which wins
        return _rope(hf).get("rope_theta", hf.get(key, defaults[key]))
    value = hf.get(key, defaults[key])
    if field == "num_kv_heads" and value is None:
        return hf_value(hf, "num_attention_heads", defaults)
    return value


def hf_is_default(hf: dict[str, Any], field: str) -> bool:
    """True when `field` came from HF's default (config.json does not set it)."""
    if field == "rope_theta":
        return "rope_theta" not in _rope(hf) and HF_KEYS[field] not in hf
    return HF_KEYS[field] not in hf


def convert(field: str, value: Any) -> Any:
    """`value` as ModelConfig's type for `field`; TypeError when HF would refuse it too."""
    kind = type(getattr(ModelConfig(), field))
    if kind is list:  # a list of layer indices (mlp_only_layers)
        if not (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise TypeError(f"config.json {field}={value!r} is not a list of integers")
        return list(value)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"config.json {HF_KEYS.get(field, field)}={value!r} is not a {kind.__name__}")
    return kind(value)


def unsupported(hf: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(config.json key, value, why) for every setting the dense Qwen3 model does not implement."""
    out = [
        (k, hf[k], "a mixture-of-experts model, which the dense profiles do not describe")
        for k in MOE_KEYS
        if hf.get(k)
    ]
    out += [(k, hf[k], f"the contract model runs {k}={v!r} only") for k, v in _FIXED.items() if hf.get(k, v) != v]
    rope_type = _rope(hf).get("rope_type", _rope(hf).get("type", "default"))
    if rope_type != "default":
        out.append(("rope_parameters", _rope(hf), "the contract model runs the default RoPE only"))
    return out


def config_from_hf(hf: dict[str, Any], base: ModelConfig | None = None) -> ModelConfig:
    """config.json -> ModelConfig: the architecture fields from `hf` (HF's defaults for absent keys), the
    labels (name, seed, paths) from `base`. Raises ValueError on a model this family does not describe."""
    problems = unsupported(hf)
    if problems:
        raise ValueError("; ".join(f"config.json has {k}={v!r}: {why}" for k, v, why in problems))
    values = {f: hf_value(hf, f) for f in HF_KEYS}
    if values["architecture"] is None:  # no class named: nothing to check it against ("" never matches)
        values["architecture"] = ""
    return replace(base or ModelConfig(), family=MODEL_TYPE, **{f: convert(f, v) for f, v in values.items()})


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """ModelConfig -> config.json, every key written (so no reader needs a default); `dtype` its name."""
    return {
        "architectures": [cfg.architecture] if cfg.architecture else None,
        "model_type": MODEL_TYPE,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,  # transformers < 5 reads it here, >= 5 under rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        **_FIXED,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# --- parameter names and the TP plan ----------------------------------------------------------------
COLUMN, ROW, REPLICATED, VOCAB = "column", "row", "replicated", "vocab"
# The dim a TP rank holds a slice of: column-parallel weights split their output rows, row-parallel ones
# their input columns; VOCAB weights split their rows over the padded vocab (the LM head, Megatron's
# embedding). The engines fuse (q/k/v, gate/up) after sharding each HF weight by this plan.
SHARD_DIM: dict[str, int | None] = {COLUMN: 0, ROW: 1, VOCAB: 0, REPLICATED: None}

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
# Per decoder layer, in forward order: the parameter under model.layers.{i}. -> its TP kind.
LAYER_PARAMS: dict[str, str] = {
    "input_layernorm.weight": REPLICATED,
    "self_attn.q_proj.weight": COLUMN,
    "self_attn.k_proj.weight": COLUMN,
    "self_attn.v_proj.weight": COLUMN,
    "self_attn.o_proj.weight": ROW,
    "self_attn.q_norm.weight": REPLICATED,
    "self_attn.k_norm.weight": REPLICATED,
    "post_attention_layernorm.weight": REPLICATED,
    "mlp.gate_proj.weight": COLUMN,
    "mlp.up_proj.weight": COLUMN,
    "mlp.down_proj.weight": ROW,
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def layer_param(layer: int, suffix: str) -> str:
    return f"model.layers.{layer}.{suffix}"


def parse_layer_param(name: str) -> tuple[int, str] | None:
    """(layer, suffix) of a decoder-layer parameter name; None for any other name."""
    m = _LAYER.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m and m.group(2) in LAYER_PARAMS else None


@dataclass(frozen=True)
class HFParam:
    shape: tuple[int, ...]
    tp: str  # COLUMN | ROW | REPLICATED | VOCAB

    @property
    def shard_dim(self) -> int | None:
        return SHARD_DIM[self.tp]


def _layer_shape(cfg: ModelConfig, suffix: str) -> tuple[int, ...]:
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "self_attn.q_proj.weight": (cfg.q_size, h),
        "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h),
        "self_attn.o_proj.weight": (h, cfg.q_size),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    return shapes.get(suffix, (h,))  # the two layer norms


def hf_params(cfg: ModelConfig) -> dict[str, HFParam]:
    """Every HF parameter of the model (the LM head only when untied), in a fixed order, with its shape
    and TP kind."""
    out = {EMBED: HFParam((cfg.vocab_size, cfg.hidden_size), VOCAB)}
    for i in range(cfg.num_layers):
        out.update({layer_param(i, s): HFParam(_layer_shape(cfg, s), tp) for s, tp in LAYER_PARAMS.items()})
    out[FINAL_NORM] = HFParam((cfg.hidden_size,), REPLICATED)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = HFParam((cfg.vocab_size, cfg.hidden_size), VOCAB)
    return out


def tp_kind(name: str) -> str:
    """The TP kind of an HF parameter name (KeyError for a name the family does not have)."""
    if name in (EMBED, LM_HEAD):
        return VOCAB
    if name == FINAL_NORM:
        return REPLICATED
    parsed = parse_layer_param(name)
    if parsed is None:
        raise KeyError(f"not a Qwen3 parameter: {name}")
    return LAYER_PARAMS[parsed[1]]
