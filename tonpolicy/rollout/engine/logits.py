"""From fp32 logits rows to what a request gets back: the sampled token, its logprob and the top-k
(the kernel set's logprob recipe), and the full-forward reference scorer the engine must match bitwise.

Each request owns a torch.Generator seeded from its seed and draws exactly one multinomial sample per
generated token, so its tokens depend only on its own logits rows (bit-identical under the `invariant`
kernels whatever the batch) and its seed.
"""

from __future__ import annotations

import torch

from tonpolicy.kernels import logprob_temperature
from tonpolicy.model.qwen3 import Qwen3


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


@torch.no_grad()
def score_logprobs(model: Qwen3, prompt_ids: list[int], response_ids: list[int], temperature: float) -> torch.Tensor:
    """fp32 logprob of each response token t, from the logits at position t-1 of prompt+response."""
    if not prompt_ids:
        raise ValueError("prompt must be non-empty")
    ids = torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long)
    logits = model(ids)
    p = len(prompt_ids)
    rows = logits[p - 1 : p - 1 + len(response_ids)]
    tokens = torch.tensor(response_ids, dtype=torch.long, device=logits.device)
    return model.kernels.logprobs(rows, tokens, model.cfg.vocab_size, logprob_temperature(temperature)).cpu()


def top_logprobs(model: Qwen3, row: torch.Tensor, k: int, temperature: float) -> list[tuple[float, int]]:
    """The k most likely tokens of one fp32 logits row [padded_vocab], as (logprob, id), most likely
    first. Values come from the kernel set's logprob, so the sampled token's entry equals its logprob."""
    vocab = model.cfg.vocab_size
    k = min(k, vocab)
    ids = torch.topk(row[:vocab], k).indices  # logprob order is logit order
    values = model.kernels.logprobs(row.unsqueeze(0).expand(k, -1), ids, vocab, logprob_temperature(temperature))
    return [(float(v), int(t)) for v, t in zip(values.cpu().tolist(), ids.cpu().tolist(), strict=True)]
