"""Block-scaled FP8 checkpoints in the published format (DeepSeek-V3, Qwen/Qwen3-*-FP8): config.json's
`quantization_config` = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}, each quantized linear's `<name>.weight` stored as float8_e4m3fn with an
fp32 `<name>.weight_scale_inv` beside it (one scale per 128 x 128 block), every other tensor (embeddings,
norms, the LM head, the MoE router) in the checkpoint's dtype.

Loading dequantizes (q.float() * scale_inv, `dequantize_weight_blocks`) into master weights; saving
quantizes the masters with `quantize_weight_blocks`, the one rule the trainer's fake quantization and the
rollout engine apply, so a saved checkpoint holds exactly the FP8 weights the policy ran with."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from tonpolicy.kernels.fp8_block import BLOCK, dequantize_weight_blocks, quantize_weight_blocks

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`
QUANT_FORMAT = "fp8_block"  # contract.quant's name for this format


def quantization_config() -> dict[str, Any]:
    """The `quantization_config` a saved checkpoint's config.json carries (Qwen3-FP8's keys)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


def is_quantized_linear(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """The tensors the format quantizes: each linear's 2-D weight (attention q/k/v/o, the MLP's and every
    expert's gate/up/down), as Qwen3-FP8 does; embeddings, the LM head, norms and the router stay as
    they are."""
    return len(shape) == 2 and name.endswith("_proj.weight")


def read_fp8_format(hf: Mapping[str, Any], where: str) -> tuple[str, ...] | None:
    """None when config.json (`where`, its path) declares no quantization; else the module names its
    `modules_to_not_convert` (or `ignored_layers`) leaves unquantized. Any other quantization is refused
    with the key, its value and the rule."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"{where}: quantization_config={qc!r} must be an object")
    rules = [
        ("quant_method", "fp8", "only block-scaled FP8 checkpoints ('fp8') are supported"),
        ("fmt", "e4m3", "the weights must be float8_e4m3fn ('e4m3')"),
        ("activation_scheme", "dynamic", "activations are quantized per token at run time ('dynamic')"),
        ("weight_block_size", [BLOCK, BLOCK], f"weight scales are per {BLOCK} x {BLOCK} block"),
    ]
    for key, want, rule in rules:
        got = qc.get(key, "e4m3" if key == "fmt" else None)  # published configs may leave fmt out
        if got != want and not (key == "weight_block_size" and isinstance(got, tuple) and list(got) == want):
            raise ValueError(f"{where}: quantization_config.{key}={got!r} is not supported: {rule} ({want!r})")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise ValueError(f"{where}: quantization_config.scale_fmt={scale_fmt!r} is not supported: 'float' or 'ue8m0'")
    if scale_fmt == "ue8m0":
        log.warning(
            "%s: power-of-two scales (scale_fmt='ue8m0') are read as master weights; the contract quantizes "
            "them again by its own rule (amax / 448), so the FP8 weights it runs differ from the stored ones",
            where,
        )
    skipped = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    return tuple(str(m) for m in skipped)


def dequantize_state_dict(
    sd: Mapping[str, torch.Tensor], dtype: torch.dtype, files: Mapping[str, str], where: str
) -> dict[str, torch.Tensor]:
    """The master weights of an FP8 state dict: each float8_e4m3fn weight times its `_scale_inv`, in
    `dtype` (one fp32 product, then rounded to `dtype`); every other tensor as stored. `files`: the
    weight file of each key, named in the errors; `where`: the checkpoint."""

    def at(key: str) -> str:
        return f"{where}/{files.get(key, '?')}"

    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in sd:
                raise ValueError(f"{at(name)}: {name} has no weight {name.removesuffix(SCALE_SUFFIX)!r} beside it")
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = sd.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"{at(name)}: {name} is float8_e4m3fn but {name + SCALE_SUFFIX} is missing")
            if scale.dtype != torch.float32:
                raise ValueError(f"{at(name + SCALE_SUFFIX)}: {name + SCALE_SUFFIX} is {scale.dtype}, must be float32")
            try:
                out[name] = dequantize_weight_blocks(t, scale, dtype)
            except ValueError as e:
                raise ValueError(f"{at(name)}: {name}: {e}") from None
        elif t.dtype.is_floating_point and t.element_size() == 1:
            raise ValueError(f"{at(name)}: {name} is {t.dtype}; only float8_e4m3fn weights are supported")
        else:
            out[name] = t
    return out


def quantize_state_dict(sd: Mapping[str, torch.Tensor], skipped: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The FP8 form of master weights: each quantized linear (`is_quantized_linear`, not under a
    `skipped` module) as (q, scale_inv), its scale right after it; every other tensor unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if is_quantized_linear(name, t.shape) and not _skipped(name, skipped):
            out[name], out[name + SCALE_SUFFIX] = quantize_weight_blocks(t)
        else:
            out[name] = t
    return out


def _skipped(name: str, skipped: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    return any(module == m or module.removeprefix("model.") == m.removeprefix("model.") for m in skipped)
