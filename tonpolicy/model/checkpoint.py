"""Hugging Face format I/O (config.json + safetensors) and the deterministic random init."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tonpolicy.config.dtypes import dtype_name
from tonpolicy.config.hf_qwen3 import LM_HEAD
from tonpolicy.config.model import ModelConfig
from tonpolicy.families import adapter, family_of_hf


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the model, in a fixed order (its family adapter's)."""
    return {name: p.shape for name, p in adapter(cfg.family).hf_params(cfg).items()}


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


# Real Qwen3 vocabularies (151936) are not the built-in tasks' ids: no word-level tokenizer for them.
TOKENIZER_MAX_VOCAB = 65536


def save_hf(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)
    dtype = next(iter(tensors.values())).dtype
    (path / "config.json").write_text(json.dumps(adapter(cfg.family).config_to_hf(cfg, dtype_name(dtype)), indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if cfg.vocab_size <= TOKENIZER_MAX_VOCAB:  # the tiny models' word-level tokenizer, for readable samples
        from tonpolicy.model.tokenizer import save_tokenizer

        save_tokenizer(path, cfg.vocab_size)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory (its config.json only)."""
    hf = json.loads((Path(path) / "config.json").read_text())
    cfg = adapter(family_of_hf(hf).name).config_from_hf(hf)
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
        sd.pop(LM_HEAD, None)
    return cfg, sd
