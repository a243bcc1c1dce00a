"""Sizes derived from a config, shared by validation and the launch plan: world size, Megatron's
microbatches per replica, the padded training sequence length."""

from __future__ import annotations

from tonpolicy.config.schema import Config

# The derived micro batch size's bound: per-microbatch overhead is paid once per this many samples
# while a microbatch's activations stay small.
DERIVED_MICRO_BATCH_MAX = 8


def micro_batch_size(cfg: Config) -> int:
    """trainer.micro_batch_size; when null, each replica's share of a PPO minibatch cut into
    parallel.num_microbatches when that is set, else the largest size up to DERIVED_MICRO_BATCH_MAX that
    cuts it into whole microbatches, at least parallel.pp of them (so the pipeline fills); 1 when no
    size does (validation then says why)."""
    if cfg.trainer.micro_batch_size is not None:
        return cfg.trainer.micro_batch_size
    replicas = max(cfg.trainer.ppo_minibatches, 1) * max(cfg.parallel.dp, 1)
    batch = cfg.experiment.prompts_per_step * cfg.experiment.samples_per_prompt
    share = batch // replicas if batch % replicas == 0 else 0
    wanted = cfg.parallel.num_microbatches
    if wanted is not None:
        return share // wanted if wanted >= 1 and share % wanted == 0 and share >= wanted else 1
    for size in range(min(DERIVED_MICRO_BATCH_MAX, share), 1, -1):
        if share % size == 0 and share // size >= max(cfg.parallel.pp, 1):
            return size
    return 1


def microbatches_per_replica(cfg: Config) -> int:
    """Megatron's num_microbatches per PPO minibatch: batch / (ppo_minibatches * dp * micro_batch_size)."""
    batch = cfg.experiment.prompts_per_step * cfg.experiment.samples_per_prompt
    return batch // (cfg.trainer.ppo_minibatches * cfg.parallel.dp * micro_batch_size(cfg))


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
