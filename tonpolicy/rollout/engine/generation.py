"""One generation's request and result in the embedded rollout engine (`GenRequest`, `GenResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A top-logprobs entry: (fp32 logprob, token id), most likely first (SGLang's order).
TopLogprobs = list[tuple[float, int]]


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
    ignore_eos: bool = False  # run to max_new_tokens: no EOS and no stop_token_ids stop it (SGLang)
    top_logprobs_num: int = 0  # also report the k most likely tokens at each sampled position
    # Also report the logprob of each prompt token after this position (SGLang's logprob_start_len:
    # the start position's own logprob is null there, as position 0's must be); None: none.
    prompt_logprobs_from: int | None = None
    # Also report the experts each MoE layer routed every fed position to (SGLang's
    # return_routed_experts): positions [0, prompt + output - 1), the last output token is never fed.
    return_routed_experts: bool = False


@dataclass
class GenResult:
    output_ids: list[int]  # includes the stop token when one ended the request
    output_logprobs: torch.Tensor  # fp32 [len(output_ids)], from the step that sampled each token
    finish_reason: str  # "stop", "length", "error" (this request alone failed), "" while running
    error: str | None = None
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per output token, if asked
    # Prompt position -> logprob of that prompt token (positions > prompt_logprobs_from).
    prompt_logprobs: dict[int, float] = field(default_factory=dict)
    prompt_top_logprobs: dict[int, TopLogprobs] = field(default_factory=dict)
    # int32 [positions, num_layers, top_k] expert ids in ascending order, -1 in dense layers; if asked.
    routed_experts: torch.Tensor | None = None
    # Prompt tokens whose keys/values came from the prefix cache (SGLang's meta_info.cached_tokens).
    cached_tokens: int = 0
