"""Sizes derived from a config, shared by validation and the launch plan: the step's batch, the
layout's sizes for it (tonpolicy.config.layout owns their arithmetic), the padded training sequence
length."""

from __future__ import annotations

from tonpolicy.config.layout import Layout
from tonpolicy.config.schema import Config


def step_batch(cfg: Config) -> int:
    """Samples per step: experiment.prompts_per_step * samples_per_prompt."""
    return cfg.experiment.prompts_per_step * cfg.experiment.samples_per_prompt


def micro_batch_size(cfg: Config) -> int:
    """trainer.micro_batch_size, or the layout's derived size for this batch (Layout.micro_batch_size)."""
    t = cfg.trainer
    return Layout.from_config(cfg).micro_batch_size(step_batch(cfg), t.ppo_minibatches, t.micro_batch_size)


def microbatches_per_replica(cfg: Config) -> int:
    """Megatron's num_microbatches per PPO minibatch: batch / (ppo_minibatches * dp * micro_batch_size)."""
    layout = Layout.from_config(cfg)
    return layout.microbatches_per_replica(step_batch(cfg), cfg.trainer.ppo_minibatches, micro_batch_size(cfg))


def world_size(cfg: Config) -> int:
    return Layout.from_config(cfg).world_size


def seq_pad_multiple(cfg: Config) -> int:
    """The smallest multiple training sequences are padded to: trainer.seq_pad_multiple, else the
    layout's."""
    if cfg.trainer.seq_pad_multiple is not None:
        return cfg.trainer.seq_pad_multiple
    return Layout.from_config(cfg).pad_multiple(cfg.contract.attention_tile)


# The most tokens a multi-turn task's environment appends after one model turn (tonpolicy.rl.multi_turn).
MAX_ENV_REPLY_TOKENS = 4


def max_response_len(cfg: Config) -> int:
    """A sample's response: every model turn's tokens and the environment's replies between them."""
    e, turns = cfg.experiment, max(cfg.task.max_turns, 1)
    return e.max_new_tokens * turns + MAX_ENV_REPLY_TOKENS * (turns - 1)


def padded_seq_len(cfg: Config) -> int:
    e = cfg.experiment
    m = max(seq_pad_multiple(cfg), 1)
    return -(-(e.max_prompt_len + max_response_len(cfg)) // m) * m
