"""Kernel sets: `ordered` (contract v2: every sum an fp32 chain in an order the source owns, compiled for
the CPU), `invariant` (contract v1: exact fixed-point GEMMs in fp64, CPU and any torch device), `triton`
(the same invariances on GPU tensor cores, its own numerics) and `plain` (plain torch, the negative
control)."""

from __future__ import annotations

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

# Kernel sets that keep the contract's invariances (the others are negative controls).
INVARIANT_KERNEL_SETS = ("ordered", "invariant", "triton")
# Kernel sets whose logits may be rounded to bf16 (`logits_dtype`).
BF16_LOGITS_KERNEL_SETS = ("ordered", "invariant")

# The triton set's key tile (tonpolicy.kernels.triton_attention.TILE; here so config validation need
# not import Triton).
TRITON_ATTENTION_TILE = 64
LOGITS_DTYPES = ("float32", "bfloat16")


def weights_updated() -> None:
    """Forget every kernel set's cached weights (quantized in v1, packed in v2): call after writing weights
    in a way that bumps no tensor version (Megatron's optimizer writes its params through `.data`)."""
    from tonpolicy.kernels import exact_gemm, ordered_gemm

    exact_gemm.weights_updated()
    ordered_gemm.weights_updated()


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
    """Build a kernel set by name ("ordered", "invariant", "triton" or "plain").

    attention_tile: keys per split-KV tile; canonical_shards: K-shards of the row-parallel linears (TP
    must divide it); row_tile: every GEMM's row count is a multiple of it; prefill_row_tile: rows per
    linear GEMM for long inputs (same bits);
    logits_dtype: "float32" (an fp32 LM head GEMM) or "bfloat16" (the native bf16 one, contract only)."""
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype!r}")
    if name not in BF16_LOGITS_KERNEL_SETS and logits_dtype != "float32":
        raise ValueError(f"logits_dtype={logits_dtype!r} is a choice of the contract kernel set, not of {name!r}")
    if name in BF16_LOGITS_KERNEL_SETS:
        if name == "ordered":
            from tonpolicy.kernels.ordered import OrderedKernels as Set
        else:
            from tonpolicy.kernels.invariant import InvariantKernels as Set

        return Set(
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
    raise ValueError(f"unknown kernel set {name!r} (expected 'ordered', 'invariant', 'triton' or 'plain')")
