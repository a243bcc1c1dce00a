"""Rules of contract.quant (block-scaled FP8 linears). Called by tonpolicy.validation.validate with its
`bad(key, rule)` reporter.

fp8_block's weight blocks are 128 rows x 128 columns of each Hugging Face weight (of each canonical K-shard
of a row-parallel one), the last of a dimension partial. The embedded engine quantizes each HF weight
whole; the trainer quantizes its rank's slice of each (a block cut by TP takes the all-reduced amax), so
every trainer layout holds. Released SGLang's own rules under fp8_block are its backend's
(tonpolicy.config.sglang_rules)."""

from __future__ import annotations

from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.kernels.sets import QUANTS, kernel_set, kernel_set_names, quant_sets


def check_quant(cfg: Config, bad: Any) -> None:
    c = cfg.contract
    if c.quant not in QUANTS:
        bad("contract.quant", f"must be one of {list(QUANTS)}")
        return
    if c.quant == "none":
        return
    if c.kernels in kernel_set_names() and "quant" not in kernel_set(c.kernels).params:
        bad(
            "contract.quant",
            f"fp8_block is defined on the kernel sets {', '.join(quant_sets())}, not on contract.kernels={c.kernels}",
        )
    if not c.exact_zero:
        bad("contract.quant", "fp8_block is a contract of exact zero: contract.exact_zero must be true")
    if cfg.rollout.cuda_graphs:
        bad(
            "rollout.cuda_graphs",
            "contract.quant=fp8_block quantizes every activation after a host-side check (a NaN or inf is "
            "refused), which a CUDA graph capture cannot run: set rollout.cuda_graphs=false or leave it null",
        )
