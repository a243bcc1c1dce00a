"""Hugging Face format I/O (config.json + safetensors) and the deterministic random init."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tonpolicy.config.model import ModelConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Qwen3 dense model, in a fixed order."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def init_state_dict(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random init (HF names): N(0, init_std) matrices drawn in fp32 from one
    generator in `param_shapes` order, then cast; norm weights 1 + N(0, 0.1) so they are not trivial."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = cfg.init_std * torch.randn(shape, generator=gen)
        out[name] = t.to(dtype)
    return out


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }


# Real Qwen3 vocabularies (151936) are not the built-in tasks' ids: no word-level tokenizer for them.
TOKENIZER_MAX_VOCAB = 65536


def save_hf(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    dtype = next(iter(tensors.values())).dtype
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if cfg.vocab_size <= TOKENIZER_MAX_VOCAB:  # the tiny models' word-level tokenizer, for readable samples
        from tonpolicy.model.tokenizer import save_tokenizer

        save_tokenizer(path, cfg.vocab_size)


def config_from_hf(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
    heads = hf["num_attention_heads"]
    return replace(
        base or ModelConfig(),
        architecture=(hf.get("architectures") or ["Qwen3ForCausalLM"])[0],
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 1024),
        rope_theta=float(theta),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
    )


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory (its config.json only)."""
    cfg = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    return replace(cfg, checkpoint=str(path))


def load_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg = read_config(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        root = path.resolve()
        outside = [f for f in files if not (path / f).resolve().is_relative_to(root)]
        if outside:  # an index must not make the loader read files outside the checkpoint
            raise ValueError(f"{index.name} names weight files outside the checkpoint directory: {outside}")
    else:
        files = ["model.safetensors"]
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(path / f)))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return cfg, sd
