"""Rules of contract.quant (block-scaled FP8 linears). Called by tonpolicy.validation.validate with its
`bad(key, rule)` reporter.

fp8_block's weight blocks are 128 rows x 128 columns of each Hugging Face weight (of each canonical K-shard
of a row-parallel one): the definition holds at a layout only where the layout moves whole blocks. The
engines fuse q/k/v and gate/up per TP rank, so each weight's rows on a rank must be whole 128-row blocks
(the trainer reorders Megatron's per-group QKV interleave to [q; k; v] itself)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tonpolicy.config.errors import ConfigIssue
from tonpolicy.config.schema import Config
from tonpolicy.kernels.sets import QUANTS, kernel_set, kernel_set_names

BLOCK = 128  # tonpolicy.kernels.fp8_block.BLOCK (that module imports torch; validation must not)


def check_quant(cfg: Config, bad: Any) -> None:
    c, m = cfg.contract, cfg.model
    if c.quant not in QUANTS:
        bad("contract.quant", f"must be one of {list(QUANTS)}")
        return
    if c.quant == "none":
        return
    if c.kernels in kernel_set_names() and "quant" not in kernel_set(c.kernels).params:
        bad(
            "contract.quant",
            f"fp8_block is defined on the ordered (v2) kernel set, not on contract.kernels={c.kernels}",
        )
    if not c.exact_zero:
        bad("contract.quant", "fp8_block is a contract of exact zero: contract.exact_zero must be true")
    sizes = [
        ("model.num_attention_heads", "q_proj", m.num_attention_heads * m.head_dim),
        ("model.num_kv_heads", "k_proj and v_proj", m.num_kv_heads * m.head_dim),
        ("model.intermediate_size", "gate_proj and up_proj", m.intermediate_size),
    ]
    if m.num_experts:
        sizes.append(("model.moe_intermediate_size", "the experts' gate_proj and up_proj", m.moe_intermediate_size))
    p = cfg.parallel
    for model_key, names, size in sizes:
        for key, tp in sorted({("parallel.tp", p.tp), ("parallel.rollout_tp", p.rollout_tp)}, key=lambda e: e[1]):
            if tp < 1 or size % tp or (size // tp) % BLOCK == 0:
                continue
            where = model_key if tp == 1 else key
            bad(
                where,
                f"contract.quant=fp8_block: {names} rows per rank ({size} / TP {tp} = {size // tp}) must be a "
                f"multiple of {BLOCK}: the engines fuse q/k/v and gate/up per rank, so a rank's rows of each "
                f"weight must be whole {BLOCK}-row weight blocks",
            )
            break


def sglang_fp8_checkpoint_issues(cfg: Config, config_json: Path) -> list[ConfigIssue]:
    """Released SGLang reads a published FP8 checkpoint (`quantization_config` in config.json) into its
    Fp8Config, which it refuses to run in float32 (its FP8 method takes bf16/fp16 activations only)."""
    if cfg.rollout.backend != "sglang" or cfg.contract.dtype != "float32":
        return []
    try:
        qc = json.loads(config_json.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return []  # an unreadable config.json is reported by the checkpoint's own rules
    if not qc:
        return []
    return [
        ConfigIssue(
            "contract.dtype",
            cfg.contract.dtype,
            f"model.checkpoint={cfg.model.checkpoint} is an FP8 checkpoint (quantization_config in its "
            "config.json), which released SGLang refuses to serve in float32: use contract.dtype=bfloat16, or "
            "an unquantized checkpoint (e.g. one saved by tonpolicy without quant) for float32",
        )
    ]
