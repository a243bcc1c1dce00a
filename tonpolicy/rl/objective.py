"""The RL objective: GRPO advantages, the PPO clipped policy loss (per token) and the step metrics
users expect.

Advantage of a sample: its reward minus its prompt group's mean, over the group's std.

Loss per response token: max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(lp - lp_old),
plus kl_coef * K3(lp_old || lp); aggregated as a token mean over the batch's loss-masked tokens. Under
asynchronous steps (decoupled PPO) lp_old is the current policy's (proximal) logprob and each token's
loss is weighted by pi_proximal / pi_behaviour (the rollout's), optionally truncated (trainer.tis_cap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(rewards: list[float], group_size: int) -> list[float]:
    """Reward minus its prompt group's mean, over the group's std (0 when the group agrees)."""
    out = []
    for i in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[i : i + group_size], dtype=torch.float64)
        std = group.std(unbiased=False) if len(group) > 1 else torch.tensor(0.0, dtype=torch.float64)
        out += ((group - group.mean()) / (std + 1e-6)).tolist()
    return out


@dataclass(frozen=True)
class PPOConfig:
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's K3 estimator of KL from samples: exp(d) - 1 - d with d = log(p_other / p_sampler)."""
    return torch.exp(log_ratio) - 1.0 - log_ratio


def token_loss(lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, cfg: PPOConfig) -> torch.Tensor:
    ratio = torch.exp(lp - old_lp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high))
    if cfg.kl_coef:
        pg = pg + cfg.kl_coef * k3(old_lp - lp)
    return pg


def mean_loss(
    lp: list[torch.Tensor],
    old_lp: list[torch.Tensor],
    adv: list[torch.Tensor],
    mask: list[torch.Tensor],
    cfg: PPOConfig,
    weight: list[torch.Tensor] | None = None,
) -> float:
    """The token-mean loss over loss-masked tokens: what one update of these samples minimizes
    (`weight`: each token's importance weight under asynchronous steps, 1 when None)."""
    m = torch.cat(mask).bool() if mask else torch.zeros(0, dtype=torch.bool)
    if not m.any():
        return 0.0
    cur, old, a = (torch.cat(x).float()[m] for x in (lp, old_lp, adv))
    w = torch.cat(weight).float()[m] if weight is not None else 1.0
    return float((token_loss(cur, old, a, cfg) * w).sum() / int(m.sum()))


def importance_weights(
    proximal: list[torch.Tensor], behaviour: list[torch.Tensor], cap: float | None
) -> list[torch.Tensor]:
    """Decoupled PPO's per-token weights pi_proximal / pi_behaviour (the current policy over the one that
    sampled the token, from the rollout's logprobs), truncated at `cap` (truncated IS; None: untruncated)."""
    out = [torch.exp(p.float() - b.float()) for p, b in zip(proximal, behaviour, strict=True)]
    return out if cap is None else [w.clamp(max=cap) for w in out]


def train_rollout_metrics(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor) -> dict[str, float]:
    """How far the trainer's logprobs (flat, fp32) are from the rollout's for the same tokens."""
    diff = trainer_lp.float() - rollout_lp.float()
    n = max(diff.numel(), 1)
    return {
        "train_rollout_logprob_abs_diff": float(diff.abs().sum() / n),
        "train_rollout_logprob_max_abs_diff": float(diff.abs().max()) if diff.numel() else 0.0,
        "train_rollout_k3_kl": float(k3(diff).sum() / n),  # KL(rollout || trainer) from rollout samples
        "token_mult_prob_error": float(torch.exp(diff.abs()).sum() / n),
    }


def metrics(
    lp: list[torch.Tensor],
    old_lp: list[torch.Tensor],
    rollout_lp: list[torch.Tensor],
    adv: list[torch.Tensor],
    mask: list[torch.Tensor],
    cfg: PPOConfig,
) -> dict[str, float]:
    """Batch metrics over loss-masked tokens. `lp` is the training forward's logprobs, `old_lp` the
    trainer's recompute before the step, `rollout_lp` what the rollout engine reported."""
    m = torch.cat(mask).bool()
    cur, old, roll, a = (torch.cat(x).float()[m] for x in (lp, old_lp, rollout_lp, adv))
    n = max(int(m.sum()), 1)
    ratio = torch.exp(cur - old)
    clipped = ((a > 0) & (ratio > 1 + cfg.clip_eps_high)) | ((a < 0) & (ratio < 1 - cfg.clip_eps))
    return {
        "loss": float(token_loss(cur, old, a, cfg).sum() / n),
        **train_rollout_metrics(old, roll),
        "clipfrac": float(clipped.float().sum() / n),
        "ratio_mean": float(ratio.sum() / n),
        "ratio_min": float(ratio.min()) if ratio.numel() else 1.0,
        "ratio_max": float(ratio.max()) if ratio.numel() else 1.0,
        "tokens": float(m.sum()),
    }
