"""GRPO advantages: each sample's reward against its prompt group's."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: list[float], group_size: int) -> list[float]:
    """Reward minus its prompt group's mean, over the group's std (0 when the group agrees)."""
    out = []
    for i in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[i : i + group_size], dtype=torch.float64)
        std = group.std(unbiased=False) if len(group) > 1 else torch.tensor(0.0, dtype=torch.float64)
        out += ((group - group.mean()) / (std + 1e-6)).tolist()
    return out
