"""The step loop's Gate: exact zero passes, one flipped bit fails and names the check, the second
check's failure is named as such, and the threshold comes from the config as the README says."""

from __future__ import annotations

import torch

from tonpolicy.config.schema import Config, ContractConfig, GateConfig
from tonpolicy.loop.gate_policy import RECOMPUTE_VS_FIRST_FORWARD, ROLLOUT_VS_RECOMPUTE, Gate


def _logprobs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [-torch.rand(n, generator=g, dtype=torch.float32) * 5 for n in (7, 1, 12)]


def _one_bit_flipped(lps: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [t.clone() for t in lps]
    out[2].view(torch.int32)[4] ^= 1  # the last mantissa bit of one token: ~1e-7 away
    return out


def test_exact_zero_passes_both_checks() -> None:
    gate, lps = Gate(0), _logprobs()
    for verdict in (
        gate.rollout_vs_recompute(lps, [t.clone() for t in lps]),
        gate.recompute_vs_first_forward(lps, lps),
    ):
        assert verdict.passed and not verdict.failed and verdict.failed_check is None
        assert verdict.report.tokens_scored == 20 and verdict.report.mismatched_tokens == 0


def test_one_flipped_bit_fails_the_first_check_by_name() -> None:
    gate, lps = Gate(0, "qwen3_dense_v2"), _logprobs()
    verdict = gate.rollout_vs_recompute(lps, _one_bit_flipped(lps))
    assert verdict.failed and verdict.failed_check == ROLLOUT_VS_RECOMPUTE == "rollout_vs_recompute"
    assert verdict.report.mismatched_tokens == 1 and 0 < verdict.report.max_abs_logprob_diff < 1e-5
    message = gate.failure_message(verdict, 7)
    assert message.startswith("parity gate failed at step 7: 1 of 20 tokens differ between rollout and trainer")
    assert message.endswith("contract qwen3_dense_v2, gate.fail_on_mismatch=True; no update was made")


def test_signed_zero_is_a_mismatch() -> None:
    """Bit patterns, not values: -0.0 and +0.0 differ."""
    verdict = Gate(0).rollout_vs_recompute([torch.tensor([0.0])], [torch.tensor([-0.0])])
    assert verdict.failed and verdict.report.max_abs_logprob_diff == 0.0


def test_second_check_failure_is_named_as_such() -> None:
    gate, lps = Gate(0, "c"), _logprobs()
    assert gate.rollout_vs_recompute(lps, lps).passed
    verdict = gate.recompute_vs_first_forward(lps, _one_bit_flipped(lps))
    assert verdict.failed and verdict.failed_check == RECOMPUTE_VS_FIRST_FORWARD
    assert verdict.failed_check == "recompute_vs_first_training_forward"
    assert "1 tokens differ between the trainer's recompute and its first training forward" in (
        gate.failure_message(verdict, 0)
    )


def test_an_unenforced_gate_records_but_never_fails() -> None:
    gate, lps = Gate(None), _logprobs()
    verdict = gate.rollout_vs_recompute(lps, _one_bit_flipped(lps))
    assert verdict.passed and verdict.report.mismatched_tokens == 1 and not verdict.report.exact


def test_a_tolerance_lets_that_many_tokens_differ() -> None:
    lps = _logprobs()
    assert Gate(1).rollout_vs_recompute(lps, _one_bit_flipped(lps)).passed
    assert Gate(0).rollout_vs_recompute(lps, _one_bit_flipped(lps)).failed


def test_threshold_from_the_config() -> None:
    def gate(exact_zero: bool, fail_on_mismatch: bool | None) -> Gate:
        return Gate.of(Config(contract=ContractConfig(exact_zero=exact_zero), gate=GateConfig(fail_on_mismatch)))

    assert gate(True, None).max_mismatched == 0  # on by default for contracts that promise exact zero
    assert gate(False, None).max_mismatched is None
    assert gate(False, True).max_mismatched == 0 and gate(False, True).fail_on_mismatch
    assert gate(True, False).max_mismatched is None and not gate(True, False).fail_on_mismatch
