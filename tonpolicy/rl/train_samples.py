"""What one PPO/GRPO step trains on: the samples, their advantages and the logprobs the loss needs
(`TrainerWorker.ppo_step`'s input; which logprobs are PPO's old ones is the step's logprob reference,
docs/ARCHITECTURE.md "The gate's order")."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrainSamples:
    prompts: list[list[int]]
    responses: list[list[int]]
    # PPO's old policy per sample (fp32 [response tokens]); None: each sample's own first training forward,
    # detached (one update per step only: that forward precedes it, and under the contract it is the same bits)
    old_logprobs: list[torch.Tensor] | None
    rollout_logprobs: list[torch.Tensor]  # the rollout's, for the train_rollout_* metrics
    advantages: list[float]  # one per sample, every one of its response tokens'
    # A multi-turn task's: True where the token carries loss (the model's), False for the environment's.
    # None: every token carries loss.
    loss_masks: list[torch.Tensor] | None = None
    # Decoupled PPO (asynchronous steps): the behaviour policy's (the rollout's); each token's loss is
    # weighted by pi_old / pi_behaviour (trainer.tis_cap truncates it). None: plain PPO.
    behaviour_logprobs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def minibatches(self, count: int) -> list[list[int]]:
        """The samples in `count` contiguous minibatches (batch order, the same on every rank)."""
        n = len(self)
        if count < 1 or n % count:
            raise ValueError(f"trainer.ppo_minibatches={count} must divide the batch's {n} samples")
        return [list(range(j, j + n // count)) for j in range(0, n, n // count)]
