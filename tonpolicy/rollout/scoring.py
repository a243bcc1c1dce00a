"""Score a response with one full-sequence forward (the reference the engine must match bitwise)."""

from __future__ import annotations

import torch

from tonpolicy.kernels import logprob_temperature
from tonpolicy.model.qwen3 import Qwen3


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
