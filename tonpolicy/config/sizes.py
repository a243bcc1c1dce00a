"""Sizes derived from a config, shared by validation and the launch plan: world size, Megatron's
microbatches per replica, the padded training sequence length."""

from __future__ import annotations

from tonpolicy.config.schema import Config


def microbatches_per_replica(cfg: Config) -> int:
    """Megatron's num_microbatches per PPO minibatch: batch / (ppo_minibatches * dp * micro_batch_size)."""
    batch = cfg.experiment.prompts_per_step * cfg.experiment.samples_per_prompt
    return batch // (cfg.trainer.ppo_minibatches * cfg.parallel.dp * cfg.trainer.micro_batch_size)


def world_size(cfg: Config) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp * p.dp


def seq_pad_multiple(cfg: Config) -> int:
    """The smallest multiple training sequences are padded to for this layout."""
    if cfg.trainer.seq_pad_multiple is not None:
        return cfg.trainer.seq_pad_multiple
    p, tile = cfg.parallel, cfg.contract.attention_tile
    if p.cp_type == "ring":
        return 2 * p.cp * tile
    if p.cp_type == "ulysses":
        return p.cp
    return 1


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
