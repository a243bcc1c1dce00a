"""The exact-zero gate as the step loop applies it: its checks, each comparing fp32 bit patterns with
`contract.gate.compare_logprobs` (the one equality rule), and the threshold that turns a comparison
into a verdict. Which checks a step runs, and in what order: docs/ARCHITECTURE.md "The gate's order".

For an MoE model it also measures (never fails on) `routing_agreement`: how often the trainer's
routers sent a token to the same experts as the rollout's did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tonpolicy.config.schema import Config
from tonpolicy.contract.gate import ParityReport, compare_logprobs

ROLLOUT_VS_RECOMPUTE = "rollout_vs_recompute"
RECOMPUTE_VS_FIRST_FORWARD = "recompute_vs_first_training_forward"
ROLLOUT_VS_FIRST_FORWARD = "rollout_vs_first_training_forward"
# Asynchronous steps (experiment.max_staleness >= 1): each token's rollout logprob against the trainer's
# under the policy version that sampled it (tonpolicy.loop.staleness), before the update.
ROLLOUT_VS_SAMPLING_VERSION = "rollout_vs_sampling_version"


def recomputes_logprobs(cfg: Config) -> bool:
    """trainer.recompute_logprobs resolved: null means off exactly where the contract promises exact zero."""
    if cfg.trainer.recompute_logprobs is None:
        return not cfg.contract.exact_zero
    return cfg.trainer.recompute_logprobs


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: what it compared (`report`) and whether the gate fails the step on it."""

    check: str  # one of the check names above
    report: ParityReport
    failed: bool

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def failed_check(self) -> str | None:
        """The record's `gate_check`: the check that failed, None when it passed."""
        return self.check if self.failed else None

    def what_differs(self) -> str:
        r = self.report
        if self.check == ROLLOUT_VS_RECOMPUTE:
            return (
                f"{r.mismatched_tokens} of {r.tokens_scored} tokens differ between rollout "
                f"and trainer recompute (max |Δlogprob| {r.max_abs_logprob_diff:.3e})"
            )
        if self.check == ROLLOUT_VS_SAMPLING_VERSION:
            return (
                f"{r.mismatched_tokens} of {r.tokens_scored} tokens differ between rollout and the trainer "
                f"under the policy version that sampled each (max |Δlogprob| {r.max_abs_logprob_diff:.3e})"
            )
        if self.check == ROLLOUT_VS_FIRST_FORWARD:
            return (
                f"{r.mismatched_tokens} of {r.tokens_scored} tokens differ between rollout and the "
                f"trainer's first training forward (max |Δlogprob| {r.max_abs_logprob_diff:.3e})"
            )
        return (
            f"{r.mismatched_tokens} tokens differ between the trainer's recompute "
            f"and its first training forward (max |Δlogprob| {r.max_abs_logprob_diff:.3e})"
        )


def routing_agreement(
    rollout: list[torch.Tensor], trainer: list[torch.Tensor], prompt_lens: list[int], moe_layers: list[int]
) -> float | None:
    """Fraction of (token, MoE layer) pairs whose expert sets agree, over the positions that produced
    response tokens (prompt_len-1 .. prompt_len+R-2). `rollout[i]`: int32 [fed positions, layers, k] (the
    server's, from position 0); `trainer[i]`: [R, layers, k] (the recompute's, at those positions only).
    None when there is nothing to compare."""
    agree = total = 0
    for r, t, p in zip(rollout, trainer, prompt_lens, strict=True):
        n = t.shape[0]
        if r.shape[0] != p + n - 1 or r.shape[1:] != t.shape[1:]:
            raise ValueError(f"rollout routes {tuple(r.shape)} do not fit prompt {p} + response {n} ({tuple(t.shape)})")
        # sorted, so equal rows are equal sets whatever order each side listed its experts in
        a = r[p - 1 :, moe_layers].sort(dim=-1).values
        b = t[:, moe_layers].to(r.dtype).sort(dim=-1).values
        agree += int((a == b).all(dim=-1).sum())
        total += n * len(moe_layers)
    return agree / total if total else None


def model_tokens(
    a: list[torch.Tensor], b: list[torch.Tensor], masks: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both sides' logprobs at the model's tokens only (`masks[i]` True), or as they are without masks."""
    if masks is None:
        return a, b
    a = [x.flatten()[m.bool()] for x, m in zip(a, masks, strict=True)]
    return a, [y.flatten()[m.bool()] for y, m in zip(b, masks, strict=True)]


class Gate:
    """`max_mismatched`: the tokens a check may find differing and still pass; 0 is exact zero, None
    records the comparison and never fails (a contract that does not promise exact zero)."""

    def __init__(self, max_mismatched: int | None, contract: str = "") -> None:
        self.max_mismatched, self.contract = max_mismatched, contract

    @classmethod
    def of(cls, cfg: Config) -> Gate:
        fail_on_mismatch = cfg.gate.fail_on_mismatch
        if fail_on_mismatch is None:  # fail exactly when the contract promises exact zero
            fail_on_mismatch = cfg.contract.exact_zero
        return cls(0 if fail_on_mismatch else None, cfg.contract.name)

    @property
    def fail_on_mismatch(self) -> bool:
        return self.max_mismatched is not None

    def _verdict(self, check: str, report: ParityReport) -> Verdict:
        failed = self.max_mismatched is not None and report.mismatched_tokens > self.max_mismatched
        return Verdict(check, report, failed)

    # `masks` (a multi-turn task's, per sample bool [response tokens]): compare only the model's tokens,
    # the environment's have no rollout logprob. None: every token is the model's.
    def rollout_vs_recompute(
        self, rollout: list[torch.Tensor], recompute: list[torch.Tensor], masks: list[torch.Tensor] | None = None
    ) -> Verdict:
        return self._verdict(ROLLOUT_VS_RECOMPUTE, compare_logprobs(*model_tokens(rollout, recompute, masks)))

    def recompute_vs_first_forward(
        self, recompute: list[torch.Tensor], first_forward: list[torch.Tensor], masks: list[torch.Tensor] | None = None
    ) -> Verdict:
        report = compare_logprobs(*model_tokens(recompute, first_forward, masks))
        return self._verdict(RECOMPUTE_VS_FIRST_FORWARD, report)

    def rollout_vs_first_forward(
        self, rollout: list[torch.Tensor], first_forward: list[torch.Tensor], masks: list[torch.Tensor] | None = None
    ) -> Verdict:
        return self._verdict(ROLLOUT_VS_FIRST_FORWARD, compare_logprobs(*model_tokens(rollout, first_forward, masks)))

    def rollout_vs_sampling_version(
        self, rollout: list[torch.Tensor], trainer: list[torch.Tensor], masks: list[torch.Tensor] | None = None
    ) -> Verdict:
        report = compare_logprobs(*model_tokens(rollout, trainer, masks))
        return self._verdict(ROLLOUT_VS_SAMPLING_VERSION, report)

    def failure_message(self, verdict: Verdict, step: int) -> str:
        return (
            f"parity gate failed at step {step}: {verdict.what_differs()}; contract {self.contract}, "
            f"gate.fail_on_mismatch={self.fail_on_mismatch}; no update was made"
        )
