"""The contract GEMM's bit budget (tonpolicy.kernels.invariant.exact_gemm's definition): how many bits each
operand keeps for a contraction, and exact powers of two. Shared by the torch path (exact_gemm) and the
compiled one (exact_gemv), which must agree on every bit."""

from __future__ import annotations

import math

import torch

# Bits an fp32 A operand must keep near its row's max to be taken in one slice (its significand has 24).
WHOLE_FP32_BITS = 23
# Bits of a B operand (weights, keys, values) whenever A or B is fp32: an fp32 significand, whole.
B_BITS = 24
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def contraction_bits(a_dtype: torch.dtype, b_dtype: torch.dtype, k: int) -> tuple[int, int, int]:
    """(bits of A, bits of B, slices of A) for a contraction of length k."""
    lg = math.ceil(math.log2(max(k, 1)))
    if a_dtype in _LOW_PRECISION and b_dtype in _LOW_PRECISION:
        bits = (53 - lg) // 2
        return bits, bits, 1
    bits_b = min(B_BITS, 41 - lg)
    bits_a = 53 - lg - bits_b
    return bits_a, bits_b, 1 if a_dtype in _LOW_PRECISION or bits_a >= WHOLE_FP32_BITS else 2


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e in fp64, built from its bit pattern (exact by construction; e within fp64's normal range)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
