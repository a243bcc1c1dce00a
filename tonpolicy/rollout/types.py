"""Request/result types of the embedded rollout engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # <= 0 means greedy (logprobs then use temperature 1)
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    arrival_step: int = 0  # engine step at which the request becomes visible to the scheduler


@dataclass
class GenResult:
    output_ids: list[int]  # includes the stop token when one ended the request
    output_logprobs: torch.Tensor  # fp32 [len(output_ids)], from the step that sampled each token
    finish_reason: str  # "stop", "length", or "error" (this request alone failed; see `error`)
    error: str | None = None


def logprob_temperature(temperature: float) -> float:
    """Temperature used for logprobs: greedy requests report plain (temperature 1) logprobs."""
    return temperature if temperature > 0 else 1.0
