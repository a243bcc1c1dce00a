"""Kernel sets: `ordered` (contract v2: every sum an fp32 chain in an order the source owns, compiled for
the CPU), `invariant` (contract v1: exact fixed-point GEMMs in fp64, CPU and any torch device), `triton`
(the same invariances on GPU tensor cores, its own numerics) and `plain` (plain torch, the negative
control)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tonpolicy.kernels.sets import LOGITS_DTYPES, QUANTS, kernel_set, kernel_sets, quant_sets

if TYPE_CHECKING:
    from tonpolicy.kernels.base import AttnPartial, KernelSet

__all__ = [
    "AttnPartial",
    "BF16_LOGITS_KERNEL_SETS",
    "INVARIANT_KERNEL_SETS",
    "KernelSet",
    "TRITON_ATTENTION_TILE",
    "get_kernels",
    "logprob_temperature",
    "padded_vocab_size",
    "weights_updated",
]

# Read from the registry (tonpolicy.kernels.sets); this package imports torch only when a set is built,
# so configuration code can ask these without it.
INVARIANT_KERNEL_SETS = tuple(s.name for s in kernel_sets() if s.invariant)
BF16_LOGITS_KERNEL_SETS = tuple(s.name for s in kernel_sets() if s.bf16_logits)
TRITON_ATTENTION_TILE = kernel_set("triton").fixed_attention_tile


def __getattr__(name: str) -> Any:
    if name in ("AttnPartial", "KernelSet"):
        from tonpolicy.kernels import base

        return getattr(base, name)
    raise AttributeError(f"module 'tonpolicy.kernels' has no attribute {name!r}")


def weights_updated() -> None:
    """Forget every kernel set's cached weights (quantized in v1, packed in v2): call after writing weights
    in a way that bumps no tensor version (Megatron's optimizer writes its params through `.data`)."""
    from tonpolicy.kernels import weight_cache

    weight_cache.weights_updated()


def logprob_temperature(temperature: float) -> float:
    """The logprob recipe's temperature, for both engines: greedy requests report plain (temperature 1)
    logprobs."""
    return temperature if temperature > 0 else 1.0


def padded_vocab_size(vocab_size: int, canonical_shards: int) -> int:
    """Round the vocab up to a multiple of 128 * canonical_shards.

    The padding depends only on the canonical shard count, never on the TP size, so the LM head's
    column shards line up at every TP that divides the canonical count."""
    mult = 128 * canonical_shards
    return -(-vocab_size // mult) * mult


def get_kernels(
    name: str,
    *,
    attention_tile: int = 32,
    canonical_shards: int = 4,
    row_tile: int = 4,
    prefill_row_tile: int = 512,
    logits_dtype: str = "float32",
    quant: str = "none",
) -> KernelSet:
    """Build a kernel set by its registered name (tonpolicy.kernels.sets: "ordered", "invariant", "triton",
    "plain").

    attention_tile: keys per split-KV tile; canonical_shards: K-shards of the row-parallel linears (TP
    must divide it); row_tile: every GEMM's row count is a multiple of it; prefill_row_tile: rows per
    linear GEMM for long inputs (same bits);
    logits_dtype: "float32" (an fp32 LM head GEMM) or "bfloat16" (the native bf16 one, contract only);
    quant: "none" or "fp8_block" (block-scaled e4m3 linears, a choice of the ordered and triton sets)."""
    spec = kernel_set(name)
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype!r}")
    if not spec.bf16_logits and logits_dtype != "float32":
        raise ValueError(f"logits_dtype={logits_dtype!r} is a choice of the contract kernel set, not of {name!r}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if quant != "none" and "quant" not in spec.params:
        raise ValueError(f"quant={quant!r} is a choice of the kernel sets {', '.join(quant_sets())}, not of {name!r}")
    if spec.fixed_attention_tile is not None and attention_tile != spec.fixed_attention_tile:
        raise ValueError(
            f"the {name} kernel set uses {spec.fixed_attention_tile}-key tiles, got attention_tile={attention_tile}"
        )
    given = {
        "attention_tile": attention_tile,
        "canonical_shards": canonical_shards,
        "row_tile": row_tile,
        "prefill_row_tile": prefill_row_tile,
        "logits_dtype": logits_dtype,
        "quant": quant,
    }
    return spec.build_class()(**{k: given[k] for k in spec.params})
