"""One step's batch: the prompts, a sampling seed per sample, the server's samples with the logprobs
it reported, rewards and GRPO advantages. Rank 0 collects it and broadcasts it to every rank.

A multi-turn task's sample (tonpolicy.rl.multi_turn) has one response holding every model and
environment turn after the prompt, and a response mask saying whose each token is: the gate and the
loss see only the model's tokens (the rollout logprobs of the environment's are 0.0, never compared)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tonpolicy.config.schema import Config
from tonpolicy.rl.batch import sampling_params, sampling_seed, step_prompts
from tonpolicy.rl.multi_turn import is_multi_turn, run_episodes
from tonpolicy.rl.objective import grpo_advantages
from tonpolicy.rl.prompt_data import PromptData, Row
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
    # A multi-turn task's: per sample, bool [response tokens], True where the model sampled the token
    # (gated and trained on), False where the environment wrote it. None: every token is the model's.
    response_masks: list[torch.Tensor] | None = None
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache, over all requests
    # Per sample, the weight version that sampled each response token (meta_info.weight_versions).
    # None where not collected (a multi-turn task's batch).
    weight_versions: list[list[str | None]] | None = None
    reward_errors: int = 0  # calls of the user's reward function that failed (each scored 0.0)

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    @property
    def model_tokens(self) -> int:
        if self.response_masks is None:
            return sum(len(r) for r in self.responses)
        return int(sum(int(m.sum()) for m in self.response_masks))


# The user's reward function (tonpolicy.rl.user_reward.UserReward): (prompts, responses, labels, extras)
# -> (rewards, failed calls).
Score = Callable[..., tuple[list[float], int]]


def rewards_of(
    cfg: Config,
    prompts: list[list[int]],
    responses: list[list[int]],
    score: Score | None,
    rows: list[Row] | None = None,
) -> tuple[list[float], int]:
    """The samples' rewards and failed calls: the user's function when given, else the task's. `rows`:
    the data rows the prompts came from (their labels and columns reach the function)."""
    if score is not None:
        if rows is None:
            return score(prompts, responses)
        return score(prompts, responses, [r.label for r in rows], [r.extra for r in rows])
    t = cfg.task
    return [reward(t.name, p, r, t.graded_tokens, t.target_digit) for p, r in zip(prompts, responses, strict=True)], 0


def prompts_of(cfg: Config, step: int, data: PromptData | None) -> tuple[list[list[int]], list[Row] | None]:
    """The step's prompts, each repeated for its GRPO group: the user's data (with their rows) or the task's."""
    if data is None:
        return step_prompts(cfg, step), None
    e = cfg.experiment
    picked = [i for i in data.draw(step, e.prompts_per_step) for _ in range(e.samples_per_prompt)]
    return [data.ids[i] for i in picked], [data.rows[i] for i in picked]


def collect_batch(
    cfg: Config, client: Any, step: int, score: Score | None = None, data: PromptData | None = None
) -> Batch:
    """Generate the step's samples through the rollout server's client; rewards and GRPO advantages."""
    e, t = cfg.experiment, cfg.task
    prompts, rows = prompts_of(cfg, step, data)
    seeds = [sampling_seed(e.seed, step, i) for i in range(len(prompts))]
    if is_multi_turn(t.name):
        return collect_episodes(cfg, client, prompts, seeds, score)
    params = [sampling_params(cfg, s, *([data.stop_ids] if data is not None else [])) for s in seeds]
    m = cfg.model
    outs = client.generate(prompts, params, **({"return_routed_experts": True} if m.is_moe else {}))
    responses = [o["output_ids"] for o in outs]
    routes = None
    # real SGLang answers without them unless started with --enable-return-routed-experts: then no routes
    # (routing_agreement is null, and router replay refuses to run)
    if m.is_moe and all(o.get("routed_experts") is not None for o in outs):
        routes = [rollout_routes(o["routed_experts"], m.num_layers, m.num_experts_per_tok) for o in outs]
    rewards, failed = rewards_of(cfg, prompts, responses, score, rows)
    return Batch(
        prompts=prompts,
        seeds=seeds,
        responses=responses,
        rollout_logprobs=[torch.tensor(o["output_logprobs"], dtype=torch.float32) for o in outs],
        rewards=rewards,
        advantages=grpo_advantages(rewards, e.samples_per_prompt),
        routed_experts=routes,
        cached_tokens=sum(int(o.get("cached_tokens") or 0) for o in outs),
        weight_versions=[o["weight_versions"] for o in outs],
        reward_errors=failed,
    )


def turn_seed(seed: int, turn: int) -> int:
    """A sample's sampling seed at a turn (turn 0: the sample's own seed), below SGLang's 2**63."""
    return (seed + turn * 1_000_000_007) % 2**63


def collect_episodes(
    cfg: Config, client: Any, prompts: list[list[int]], seeds: list[int], score: Score | None = None
) -> Batch:
    """A multi-turn task's batch: each turn is one /generate of token ids (token in, token out)."""
    e, t = cfg.experiment, cfg.task
    if cfg.model.is_moe:  # routes of the environment's tokens would need their own bookkeeping
        raise ValueError("a multi-turn task runs a dense model (routed_experts are not kept across turns)")

    def generate(contexts: list[list[int]], turn: int) -> list[dict[str, Any]]:
        return client.generate(contexts, [sampling_params(cfg, turn_seed(s, turn)) for s in seeds])

    episodes = run_episodes(t.name, prompts, t.max_turns, generate)
    # graded on the last model turn, as the task's own reward
    rewards, failed = rewards_of(cfg, [ep.prompt for ep in episodes], [ep.turns[-1] for ep in episodes], score)
    return Batch(
        prompts=prompts,
        seeds=seeds,
        responses=[ep.response for ep in episodes],
        rollout_logprobs=[torch.tensor(ep.logprobs, dtype=torch.float32) for ep in episodes],
        rewards=rewards,
        advantages=grpo_advantages(rewards, e.samples_per_prompt),
        response_masks=[torch.tensor(ep.mask, dtype=torch.bool) for ep in episodes],
        cached_tokens=sum(ep.cached_tokens for ep in episodes),
        weight_versions=[ep.versions for ep in episodes],  # the environment's tokens: None (not sampled)
        reward_errors=failed,
    )


def rollout_routes(b64: str, num_layers: int, top_k: int) -> torch.Tensor:
    """A sample's meta_info.routed_experts as int32 [fed positions, layers, top_k]."""
    return torch.tensor(decode_routed_experts(b64, num_layers, top_k), dtype=torch.int32).reshape(-1, num_layers, top_k)
