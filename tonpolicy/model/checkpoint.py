"""Hugging Face format I/O (config.json + safetensors) and the deterministic random init."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tonpolicy.config.dtypes import dtype_name
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


# Hugging Face's default shard size: every loader and SGLang read such an index.
MAX_SHARD_BYTES = 5 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
READABLE = 0o644  # a checkpoint is read by other users' servers


def save_hf(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    path: str | Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    quant: str = "none",
) -> None:
    """A complete HF model directory: the weights (one file, or shards of at most `max_shard_bytes`
    with an index), config.json and, from the checkpoint the model came from (`cfg.checkpoint`),
    every other file that is not weights (tokenizer, chat template, generation_config.json, ...);
    its config.json keeps every key, only the dtype follows the weights. Files are 0644.
    `quant="fp8_block"` (contract.quant): the linears as published FP8 (`fp8_checkpoint`), the dtype the
    other tensors'; otherwise a source's `quantization_config` is dropped, the weights being unquantized."""
    from tonpolicy.model.fp8_checkpoint import QUANT_FORMAT, quantization_config, quantize_state_dict, read_fp8_format

    if quant not in ("none", QUANT_FORMAT):
        raise ValueError(f"save_hf: quant={quant!r} is not a checkpoint format: 'none' or {QUANT_FORMAT!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # The model's own parameter order (any other name after it), so the shards do not depend on the
    # order a state dict was built or read in: a checkpoint loaded and saved again is the same files.
    rank = {name: i for i, name in enumerate(param_shapes(cfg))}
    ordered = sorted(state_dict.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    tensors = {k: v.detach().contiguous() for k, v in ordered}
    if cfg.tie_word_embeddings:
        tensors.pop(adapter(cfg.family).LM_HEAD, None)
    dtype = dtype_name(next(iter(tensors.values())).dtype)
    source = Path(cfg.checkpoint) if cfg.checkpoint else None
    if source is not None and source.resolve() != path.resolve() and (source / "config.json").exists():
        hf = json.loads((source / "config.json").read_text())
        hf["torch_dtype"] = dtype
        if "dtype" in hf:
            hf["dtype"] = dtype
        _carry_files(source, path)
    else:
        hf = adapter(cfg.family).config_to_hf(cfg, dtype)
        if cfg.vocab_size <= TOKENIZER_MAX_VOCAB:  # the tiny models' word-level tokenizer, for readable samples
            from tonpolicy.model.tokenizer import save_tokenizer

            save_tokenizer(path, cfg.vocab_size)
    if quant == QUANT_FORMAT:
        skipped = read_fp8_format(hf, str(source / "config.json")) if "quantization_config" in hf else None
        tensors = quantize_state_dict(tensors, skipped or ())
        hf["quantization_config"] = {**hf.get("quantization_config", {}), **quantization_config()}
    else:
        hf.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    _save_weights(tensors, path, max_shard_bytes)
    for f in path.iterdir():
        if f.is_file():
            f.chmod(READABLE)


def _carry_files(source: Path, path: Path) -> None:
    for f in sorted(source.iterdir()):
        weights = f.name.endswith(WEIGHT_SUFFIXES) or f.name.endswith(".index.json")
        if f.is_file() and not weights and f.name != "config.json" and not f.name.startswith("."):
            shutil.copyfile(f, path / f.name)


def _save_weights(tensors: dict[str, torch.Tensor], path: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    if len(shards) == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory (its config.json only)."""
    hf = json.loads((Path(path) / "config.json").read_text())
    cfg = adapter(family_of_hf(hf).name).config_from_hf(hf)
    return replace(cfg, checkpoint=str(path))


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and HF-named tensors of a checkpoint directory. A published FP8 checkpoint
    (`fp8_checkpoint`) is dequantized to master weights in `dtype` (the consumer's: each FP8 weight
    rounded once); the other tensors come as stored."""
    from tonpolicy.model.fp8_checkpoint import dequantize_state_dict, read_fp8_format

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
    origin: dict[str, str] = {}
    for f in files:
        part = load_file(str(path / f))
        sd.update(part)
        origin.update(dict.fromkeys(part, f))
    read_fp8_format(json.loads((path / "config.json").read_text()), str(path / "config.json"))  # refuses others
    sd = dequantize_state_dict(sd, dtype, origin, str(path))  # FP8 tensors are refused without the format's scales
    if cfg.tie_word_embeddings:
        sd.pop(adapter(cfg.family).LM_HEAD, None)
    return cfg, sd
