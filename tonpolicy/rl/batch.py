"""One step's batch: the prompts of the task, sampling parameters (a seed per sample), the server's
samples with their logprobs, rewards and GRPO advantages."""

from __future__ import annotations

from typing import Any

import torch

from tonpolicy.config.schema import Config
from tonpolicy.rl.objective import grpo_advantages
from tonpolicy.rl.task import EOS, make_prompts, reward


def step_prompts(cfg: Config, step: int) -> list[list[int]]:
    """The step's prompts, each repeated `samples_per_prompt` times (a GRPO group is consecutive)."""
    e, t = cfg.experiment, cfg.task
    prompts = make_prompts(
        t.name,
        step,
        e.prompts_per_step,
        seed=e.seed,
        max_prompt_len=e.max_prompt_len,
        target=t.target_digit,
        max_digits=t.max_digits,
    )
    return [p for p in prompts for _ in range(e.samples_per_prompt)]


def sampling_seed(seed: int, step: int, index: int) -> int:
    """Sample `index` of step `step`: its own seed, so every sample is reproducible on its own."""
    return seed * 1_000_003 + step * 10_007 + index


def collect_batch(cfg: Config, client: Any, step: int) -> dict[str, Any]:
    """Generate the step's samples through the rollout server's client; rewards and GRPO advantages."""
    e, t = cfg.experiment, cfg.task
    batch_prompts = step_prompts(cfg, step)
    params = [
        {
            "temperature": e.temperature,
            "top_p": e.top_p,
            "top_k": e.top_k,
            "max_new_tokens": e.max_new_tokens,
            "stop_token_ids": [EOS],
            "sampling_seed": sampling_seed(e.seed, step, i),
        }
        for i in range(len(batch_prompts))
    ]
    outs = client.generate(batch_prompts, params)
    responses = [o["output_ids"] for o in outs]
    rewards = [
        reward(t.name, p, r, t.graded_tokens, t.target_digit) for p, r in zip(batch_prompts, responses, strict=True)
    ]
    return {
        "prompts": batch_prompts,
        "responses": responses,
        "rollout_logprobs": [torch.tensor(o["output_logprobs"], dtype=torch.float32) for o in outs],
        "rewards": rewards,
        "advantages": grpo_advantages(rewards, e.samples_per_prompt),
    }
