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
from tonpolicy.rollout.wire.response import decode_routed_experts


@dataclass(frozen=True)
class Batch:
    prompts: list[list[int]]
    seeds: list[int]  # sample i's sampling seed
    responses: list[list[int]]  # the rollout's token ids
    rollout_logprobs: list[torch.Tensor]  # fp32, from the decode step that sampled each token
    rewards: list[float]
    advantages: list[float]
    # An MoE model's: per sample, int32 [fed positions = prompt + response - 1, layers, top_k], the
    # experts the rollout routed each fed token to (ascending; -1 in dense layers). None for a dense model.
    routed_experts: list[torch.Tensor] | None = None

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)


def collect_batch(cfg: Config, client: Any, step: int) -> Batch:
    """Generate the step's samples through the rollout server's client; rewards and GRPO advantages."""
    e, t = cfg.experiment, cfg.task
    prompts = step_prompts(cfg, step)
    seeds = [sampling_seed(e.seed, step, i) for i in range(len(prompts))]
    params = [sampling_params(cfg, s) for s in seeds]
    m = cfg.model
    outs = client.generate(prompts, params, **({"return_routed_experts": True} if m.is_moe else {}))
    responses = [o["output_ids"] for o in outs]
    routes = None
    # real SGLang answers without them unless started with --enable-return-routed-experts: then no routes
    # (routing_agreement is null, and router replay refuses to run)
    if m.is_moe and all(o.get("routed_experts") is not None for o in outs):
        routes = [rollout_routes(o["routed_experts"], m.num_layers, m.num_experts_per_tok) for o in outs]
    rewards = [reward(t.name, p, r, t.graded_tokens, t.target_digit) for p, r in zip(prompts, responses, strict=True)]
    return Batch(
        prompts=prompts,
        seeds=seeds,
        responses=responses,
        rollout_logprobs=[torch.tensor(o["output_logprobs"], dtype=torch.float32) for o in outs],
        rewards=rewards,
        advantages=grpo_advantages(rewards, e.samples_per_prompt),
        routed_experts=routes,
    )


def rollout_routes(b64: str, num_layers: int, top_k: int) -> torch.Tensor:
    """A sample's meta_info.routed_experts as int32 [fed positions, layers, top_k]."""
    return torch.tensor(decode_routed_experts(b64, num_layers, top_k), dtype=torch.int32).reshape(-1, num_layers, top_k)
