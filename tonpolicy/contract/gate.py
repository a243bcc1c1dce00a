"""The exact-zero gate: compare rollout and trainer fp32 logprobs token by token (and the one equality
rule, `bits_differ`, that every comparison in tonpolicy uses).

Parity is equality of fp32 bit patterns (so -0.0 differs from +0.0 and NaN from NaN payloads); the
counts and max |Δ| say how far off a failing step is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

BIT_VIEW = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: same dtype -> do the bit patterns differ; different dtypes -> do the values differ.
    The one equality rule of the gate, the align reports and the harness."""
    if a.dtype == b.dtype and a.dtype in BIT_VIEW:
        return a.view(BIT_VIEW[a.dtype]) != b.view(BIT_VIEW[b.dtype])
    return a.double() != b.double()


@dataclass(frozen=True)
class ParityReport:
    tokens_scored: int
    mismatched_tokens: int
    max_abs_logprob_diff: float
    mean_abs_logprob_diff: float

    @property
    def exact(self) -> bool:
        return self.mismatched_tokens == 0

    def to_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "exact": self.exact}


def compare_logprobs(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> ParityReport:
    tokens = mismatched = 0
    max_diff = sum_diff = 0.0
    for r, t in zip(rollout, trainer, strict=True):
        r, t = r.to(torch.float32).flatten(), t.to(torch.float32).flatten()
        if r.shape != t.shape:
            raise ValueError(f"logprob count differs: rollout {tuple(r.shape)} vs trainer {tuple(t.shape)}")
        tokens += r.numel()
        mismatched += int(bits_differ(r, t).sum())
        if r.numel():
            diff = (r.double() - t.double()).abs()
            max_diff = max(max_diff, float(diff.max()))
            sum_diff += float(diff.sum())
    return ParityReport(tokens, mismatched, max_diff, sum_diff / max(tokens, 1))
