"""Published block-scaled FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3 format) in the contract package.

SGLang reads such a checkpoint's `quantization_config` into its own `Fp8Config` and hands it to the model
class. The package builds none of SGLang's linear layers, so that config selects no SGLang kernel here: the
package reads the FP8 pairs back into master weights exactly as tonpolicy's own loader does
(`tonpolicy.model.fp8_checkpoint`: q.float() * scale_inv, rounded once to the served dtype), and under
contract.quant=fp8_block its kernel set quantizes those masters again by the contract's one rule, as the
embedded engine and the trainer do. Any other quantization is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from tonpolicy.model.fp8_checkpoint import SCALE_SUFFIX, dequantize_state_dict, read_fp8_format


def check_quant_config(quant_config: Any, hf: Mapping[str, Any]) -> None:  # noqa: ANN401 - SGLang's config
    """Accept no quantization, or SGLang's Fp8Config read from a checkpoint in the published format (the
    checkpoint's own `quantization_config` checked by tonpolicy's loader rules); refuse anything else."""
    if quant_config is None:
        return
    where = f"{hf.get('_name_or_path') or 'the checkpoint'}/config.json"
    name = quant_config.get_name() if hasattr(quant_config, "get_name") else type(quant_config).__name__
    if name != "fp8" or not getattr(quant_config, "is_checkpoint_fp8_serialized", False):
        raise ValueError(
            f"the tonpolicy contract model does not run SGLang's quantization {name!r} "
            f"({type(quant_config).__name__}): it serves unquantized checkpoints and block-scaled FP8 ones "
            "(quantization_config quant_method='fp8', weight_block_size [128, 128]); for FP8 rollouts of an "
            "unquantized checkpoint set contract.quant=fp8_block and leave SGLang's --quantization unset"
        )
    if "quantization_config" not in hf:
        raise ValueError(f"{where}: SGLang was given --quantization fp8 but the checkpoint declares no quantization")
    read_fp8_format(hf, where)  # raises on anything but the published block-scaled e4m3 format


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, where: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's weight stream with each float8_e4m3fn `<name>.weight` and its `<name>.weight_scale_inv`
    (in either order, any distance apart) replaced by the master weight in `dtype`; every other tensor as
    it comes. A weight left without its scale (or a scale without its weight) is refused at the end."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
        elif t.dtype == torch.float8_e4m3fn:
            base = name
        elif t.dtype.is_floating_point and t.element_size() == 1:
            raise ValueError(f"{where}: {name} is {t.dtype}; only float8_e4m3fn weights are supported")
        else:
            yield name, t
            continue
        pending[name] = t
        if base in pending and base + SCALE_SUFFIX in pending:
            pair = {base: pending.pop(base), base + SCALE_SUFFIX: pending.pop(base + SCALE_SUFFIX)}
            yield base, dequantize_state_dict(pair, dtype, {}, where)[base]
    if pending:
        # The loader's own messages: a scale without its weight, or an FP8 weight without its scale.
        dequantize_state_dict(pending, dtype, {}, where)
        raise ValueError(f"{where}: unpaired FP8 tensors {sorted(pending)}")
