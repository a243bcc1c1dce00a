"""The equality check of the contract: fp32 bit patterns, token by token (tonpolicy.contract.gate's rule,
which the exact-zero gate, the align reports and the tests use)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tonpolicy.contract.gate import ParityReport


def parity(rollout: Sequence[Any], trainer: Sequence[Any]) -> ParityReport:
    """Compare two engines' logprobs, one sequence (a tensor or a list of floats) per sample: tokens
    scored, mismatched tokens (fp32 bit patterns differ: -0.0 is not +0.0), max and mean |Δ|. Its
    `exact` is the contract's promise: no token differs."""
    import torch

    from tonpolicy.contract.gate import compare_logprobs

    def tensors(seqs: Sequence[Any]) -> list[torch.Tensor]:
        return [s if isinstance(s, torch.Tensor) else torch.tensor(s, dtype=torch.float32) for s in seqs]

    return compare_logprobs(tensors(rollout), tensors(trainer))


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do the bit patterns differ (same dtype), or the values (different dtypes)."""
    from tonpolicy.contract.gate import bits_differ as differ

    return differ(a, b)
