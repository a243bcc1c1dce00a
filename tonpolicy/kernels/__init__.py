"""Kernel sets: `invariant` (bitwise-invariant numerics, CPU and any torch device), `triton` (the same
invariances on GPU tensor cores, its own numerics) and `plain` (plain torch, the negative control)."""

from __future__ import annotations

from tonpolicy.kernels.base import AttnPartial, KernelSet

__all__ = [
    "AttnPartial",
    "INVARIANT_KERNEL_SETS",
    "KernelSet",
    "TRITON_ATTENTION_TILE",
    "get_kernels",
    "logprob_temperature",
    "padded_vocab_size",
]

# Kernel sets that keep the contract's invariances (the others are negative controls).
INVARIANT_KERNEL_SETS = ("invariant", "triton")

# The triton set's key tile (tonpolicy.kernels.triton_attention.TILE; here so config validation need
# not import Triton).
TRITON_ATTENTION_TILE = 64
LOGITS_DTYPES = ("float32", "bfloat16")


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
) -> KernelSet:
    """Build a kernel set by name ("invariant", "triton" or "plain").

    attention_tile: keys per split-KV tile; canonical_shards: K-shards of the row-parallel linears (TP
    must divide it); row_tile: every GEMM's row count is a multiple of it; prefill_row_tile: rows per
    linear GEMM for long inputs (same bits);
    logits_dtype: "float32" (an fp32 LM head GEMM) or "bfloat16" (the native bf16 one, contract only)."""
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype!r}")
    if name != "invariant" and logits_dtype != "float32":
        raise ValueError(f"logits_dtype={logits_dtype!r} is a choice of the contract kernel set, not of {name!r}")
    if name == "invariant":
        from tonpolicy.kernels.invariant import InvariantKernels

        return InvariantKernels(
            attention_tile=attention_tile,
            canonical_shards=canonical_shards,
            row_tile=row_tile,
            prefill_row_tile=prefill_row_tile,
            logits_dtype=logits_dtype,
        )
    if name == "triton":
        # Fixed tiles of its own (64-key attention tiles); only the canonical shard count is a choice.
        from tonpolicy.kernels.triton_set import TritonKernels

        if attention_tile != TRITON_ATTENTION_TILE:
            raise ValueError(
                f"the triton kernel set uses {TRITON_ATTENTION_TILE}-key tiles, got attention_tile={attention_tile}"
            )
        return TritonKernels(canonical_shards=canonical_shards)
    if name == "plain":
        from tonpolicy.kernels.plain import PlainKernels

        return PlainKernels(attention_tile=attention_tile, canonical_shards=canonical_shards)
    raise ValueError(f"unknown kernel set {name!r} (expected 'invariant', 'triton' or 'plain')")
