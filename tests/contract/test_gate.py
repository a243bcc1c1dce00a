"""The gate compares fp32 bit patterns, not values."""

from __future__ import annotations

import torch

from tonpolicy.contract.gate import compare_logprobs


def test_signed_zero_and_nan_payloads_are_mismatches() -> None:
    a = [torch.tensor([0.0, -1.5, float("nan")])]
    same = compare_logprobs(a, [a[0].clone()])
    assert same.exact and same.mismatched_tokens == 0
    rep = compare_logprobs(a, [torch.tensor([-0.0, -1.5, float("nan")])])
    assert not rep.exact and rep.mismatched_tokens == 1  # -0.0 == 0.0 by value, not by bits
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert compare_logprobs(a, [torch.cat([a[0][:2], nan2])]).mismatched_tokens == 1


def test_counts_and_size_of_a_difference() -> None:
    rep = compare_logprobs(
        [torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [torch.tensor([1.0, 2.5]), torch.tensor([3.0])]
    )
    assert (rep.tokens_scored, rep.mismatched_tokens, rep.max_abs_logprob_diff) == (3, 1, 0.5)
