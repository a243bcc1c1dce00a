"""Rules of contract.quant (block-scaled FP8 linears). Called by tonpolicy.validation.validate with its
`bad(key, rule)` reporter.

fp8_block's weight blocks are 128 rows x 128 columns of each Hugging Face weight (of each canonical K-shard
of a row-parallel one), the last of a dimension partial. The embedded engine quantizes each HF weight
whole; the trainer quantizes its rank's slice of each (a block cut by TP takes the all-reduced amax), so
every trainer layout holds. Released SGLang's contract package does the same over its TP group: proven at
SGLang TP 2 where ranks cut whole blocks (tests/sglang/test_sglang_bpe.py: k/v 64 and gate/up 192 rows per
rank). An HF weight whose rows end in a partial block (rows not a multiple of 128) is not yet run through
SGLang by a test, so it stays refused there at every rollout_tp."""

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
    if cfg.rollout.backend != "sglang":
        return
    sizes = [
        ("model.num_attention_heads", "q_proj", m.num_attention_heads * m.head_dim),
        ("model.num_kv_heads", "k_proj and v_proj", m.num_kv_heads * m.head_dim),
        ("model.intermediate_size", "gate_proj and up_proj", m.intermediate_size),
    ]
    if m.num_experts:
        sizes.append(("model.moe_intermediate_size", "the experts' gate_proj and up_proj", m.moe_intermediate_size))
    for model_key, names, size in sizes:
        if size % BLOCK == 0:  # whole 128-row blocks, cut by SGLang's TP or not: proven (module docstring)
            continue
        bad(
            model_key,
            f"contract.quant=fp8_block with rollout=sglang: {names} rows ({size}) must be a multiple of {BLOCK}: "
            "the SGLang package's partial weight blocks are not yet proven by a test (blocks cut by SGLang's TP "
            "are; the embedded engine has no such rule: rollout=embedded)",
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
