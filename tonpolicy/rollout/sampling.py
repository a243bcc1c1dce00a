"""Per-request seeded sampling from one fp32 logits row.

Each request owns a torch.Generator seeded from its seed and draws exactly one multinomial sample per
generated token, so its tokens depend only on its own logits rows (bit-identical under `contract`
whatever the batch) and its seed.
"""

from __future__ import annotations

import torch


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_token(
    logits: torch.Tensor,
    vocab_size: int,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator,
) -> int:
    """Sample from fp32 logits [padded_vocab] over the real vocab; greedy when temperature <= 0."""
    x = logits[:vocab_size].float()
    if temperature <= 0:
        return int(torch.argmax(x))
    probs = torch.softmax(x / temperature, dim=-1)
    if 0 < top_k < vocab_size:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=0)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop_sorted = (cum - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = torch.where(drop, torch.zeros_like(probs), probs)
    return int(torch.multinomial(probs, 1, generator=generator))
