"""Asynchronous steps' exact behaviour logprobs (experiment.max_staleness=k >= 1).

At step j the trainer holds policy version j; the batch's tokens were sampled by versions j - k .. j
(tonpolicy.loop.producer). Before the update, every rank computes the trainer's logprobs under the
version that sampled each token: the kept weights of version v (tonpolicy.trainer.snapshots) for tokens
of version v < j, the proximal logprobs for tokens of version j. The proximal logprobs (decoupled PPO's
"old" policy, the PPO ratio's denominator: the current weights') are the first training forward's with
one update per step, a no-grad forward before the updates with several (the gate's checks of them:
docs/ARCHITECTURE.md "The gate's order"). The rollout's logprobs are then decoupled PPO's behaviour
policy: each token's loss is weighted by pi_proximal / pi_behaviour (trainer.tis_cap truncates it).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from tonpolicy.loop.weight_sync import policy_version


def token_versions(weight_versions: list[list[str | None]]) -> list[list[int]]:
    """Per sample, the policy version number of each response token (checked by check_versions first)."""
    out = []
    for sample in weight_versions:
        numbers = [policy_version(v) for v in sample]
        if any(n is None for n in numbers):
            raise ValueError(f"a token's weight version is not one tonpolicy gave: {sample}")
        out.append([int(n) for n in numbers])  # type: ignore[arg-type]
    return out


def staleness_histogram(versions: list[list[int]], current: int) -> dict[str, int]:
    """Tokens per staleness (current version - the version that sampled them), keys "0", "1", ..."""
    counts = Counter(current - v for sample in versions for v in sample)
    return {str(s): counts[s] for s in sorted(counts)}


def logprobs_under_sampling_versions(
    snapshots: Any,
    prompts: list[list[int]],
    responses: list[list[int]],
    versions: list[list[int]],
    current: int,
    proximal: list[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """Each token's trainer logprob under the version that sampled it (collective: every rank, same order).
    `proximal` None: the current version's tokens are left NaN, for `with_current` to fill from the first
    training forward."""
    if proximal is None:
        out = [torch.full((len(r),), float("nan")) for r in responses]
    else:
        out = [p.detach().clone().float() for p in proximal]
    for v in sorted({v for sample in versions for v in sample} - {current}):
        idx = [i for i, sample in enumerate(versions) if v in sample]
        lps = snapshots.logprobs_under(v, [prompts[i] for i in idx], [responses[i] for i in idx])
        for i, lp in zip(idx, lps, strict=True):
            at = torch.tensor([x == v for x in versions[i]], dtype=torch.bool)
            out[i][at] = lp.float()[at]
    return out


def with_current(sampled: torch.Tensor, current_lp: torch.Tensor, versions: list[int], current: int) -> torch.Tensor:
    """A sample's `sampled` logprobs with its current-version tokens taken from `current_lp` (the first
    training forward's, detached: with one update per step it is the proximal forward, at no extra cost)."""
    out = sampled.clone()
    at = torch.tensor([v == current for v in versions], dtype=torch.bool)
    out[at] = current_lp.detach().float()[at]
    return out


def async_metrics(
    versions: list[list[int]],
    current: int,
    proximal: list[torch.Tensor],
    rollout: list[torch.Tensor],
    first_forward: dict[int, torch.Tensor],
    tis_cap: float | None,
    masks: list[torch.Tensor] | None,
) -> dict[str, Any]:
    """The step record's view of staleness: the staleness histogram, the importance weights
    pi_proximal / pi_behaviour (mean, max, truncated fraction), and the ratio first forward / rollout
    over the tokens of the current version (`first_forward`: sample -> its first training forward),
    exactly 1 under the contract."""
    everything = [torch.ones(len(v), dtype=torch.bool) for v in versions]
    keep = [m.bool() for m in masks] if masks is not None else everything
    w = torch.cat([torch.exp(p.float() - r.float())[k] for p, r, k in zip(proximal, rollout, keep, strict=True)])
    out: dict[str, Any] = {
        "staleness": staleness_histogram(versions, current),
        "is_ratio_mean": float(w.mean()) if w.numel() else 1.0,
        "is_ratio_max": float(w.max()) if w.numel() else 1.0,
    }
    if tis_cap is not None:
        out["tis_truncated_frac"] = float((w > tis_cap).float().mean()) if w.numel() else 0.0
    ratios = [
        torch.exp(ff.detach().float() - rollout[i].float())[
            keep[i] & torch.tensor([v == current for v in versions[i]], dtype=torch.bool)
        ]
        for i, ff in first_forward.items()
    ]
    current_ratios = torch.cat(ratios) if ratios else torch.zeros(0)
    if current_ratios.numel():  # absent when no token of the checked samples is of the current version
        out["first_forward_ratio_current_min"] = float(current_ratios.min())
        out["first_forward_ratio_current_max"] = float(current_ratios.max())
    return out
