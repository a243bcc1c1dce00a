"""One step's batch: the prompts, a sampling seed per sample, the server's samples with the logprobs
it reported, rewards and GRPO advantages. Rank 0 collects it and broadcasts it to every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tonpolicy.config.schema import Config
from tonpolicy.rl.batch import sampling_params, sampling_seed, step_prompts
from tonpolicy.rl.objective import grpo_advantages
from tonpolicy.rl.task import reward


@dataclass(frozen=True)
class Batch:
    prompts: list[list[int]]
    seeds: list[int]  # sample i's sampling seed
    responses: list[list[int]]  # the rollout's token ids
    rollout_logprobs: list[torch.Tensor]  # fp32, from the decode step that sampled each token
    rewards: list[float]
    advantages: list[float]

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)


def collect_batch(cfg: Config, client: Any, step: int) -> Batch:
    """Generate the step's samples through the rollout server's client; rewards and GRPO advantages."""
    e, t = cfg.experiment, cfg.task
    prompts = step_prompts(cfg, step)
    seeds = [sampling_seed(e.seed, step, i) for i in range(len(prompts))]
    outs = client.generate(prompts, [sampling_params(cfg, s) for s in seeds])
    responses = [o["output_ids"] for o in outs]
    rewards = [reward(t.name, p, r, t.graded_tokens, t.target_digit) for p, r in zip(prompts, responses, strict=True)]
    return Batch(
        prompts=prompts,
        seeds=seeds,
        responses=responses,
        rollout_logprobs=[torch.tensor(o["output_logprobs"], dtype=torch.float32) for o in outs],
        rewards=rewards,
        advantages=grpo_advantages(rewards, e.samples_per_prompt),
    )
