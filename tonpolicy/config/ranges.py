"""Ranges of every numeric field a process acts on (and, through their own modules, the rollout server's
access and the fleet's rules). Called by tonpolicy.validation.validate with its `bad(key, rule)` reporter."""

from __future__ import annotations

import math
from typing import Any

from tonpolicy.config.fleet_rules import check_fleet
from tonpolicy.config.schema import Config, value_at
from tonpolicy.config.server_access import check_server_access
from tonpolicy.config.sizes import padded_seq_len, seq_pad_multiple

SEED_MAX = 2**32 - 1  # PYTHONHASHSEED's range
MIN_TEMPERATURE = 1e-6  # below this SGLang and the embedded server sample greedily
WEIGHT_SYNC_MODES = ("disk", "distributed")


def check_ranges(cfg: Config, bad: Any) -> None:
    """Every numeric field a process acts on has a range."""
    e, r, t = cfg.experiment, cfg.rollout, cfg.trainer
    if not 0 <= e.seed <= SEED_MAX:
        bad("experiment.seed", f"must be in [0, {SEED_MAX}] (it is PYTHONHASHSEED and seeds every generator)")
    if not (math.isfinite(e.temperature) and e.temperature >= MIN_TEMPERATURE):
        bad(
            "experiment.temperature",
            f"must be finite and >= {MIN_TEMPERATURE} (logprobs are log_softmax(logits / "
            "temperature); both rollout servers treat smaller values as greedy)",
        )
    if not (math.isfinite(e.top_p) and 0 < e.top_p <= 1):
        bad("experiment.top_p", "must be in (0, 1]")
    if e.top_k != -1 and e.top_k < 1:
        bad("experiment.top_k", "must be -1 (off) or >= 1")
    if cfg.checkpoint.save_every < 0:
        bad("checkpoint.save_every", "must be >= 0 (0: save after the last step only)")
    if e.max_prompt_len >= 1 and e.max_new_tokens >= 1 and padded_seq_len(cfg) > cfg.model.max_position_embeddings:
        bad(
            "experiment.max_new_tokens",
            f"max_prompt_len + max_new_tokens (padded to {seq_pad_multiple(cfg)}) = "
            f"{padded_seq_len(cfg)} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}",
        )
    for key, port in (("rollout.port", r.port), ("trainer.master_port", t.master_port)):
        if not 0 <= port <= 65535:
            bad(key, "must be in [0, 65535] (0 picks a free port)")
    for key, seconds in (
        ("rollout.health_timeout_s", r.health_timeout_s),
        ("trainer.timeout_s", t.timeout_s),
        ("rollout.liveness_timeout_s", r.liveness_timeout_s),
        ("reward.timeout_s", cfg.reward.timeout_s),
    ):
        if not (math.isfinite(seconds) and seconds > 0):
            bad(key, "must be a positive number of seconds")
    for key, value in (
        ("rollout.chunked_prefill_size", r.chunked_prefill_size),
        ("rollout.max_total_tokens", r.max_total_tokens),
        ("trainer.nproc_per_node", t.nproc_per_node),
        ("trainer.seq_pad_multiple", t.seq_pad_multiple),
    ):
        if value is not None and value < 1:
            bad(key, "must be a positive integer (or null)")
    check_server_access(cfg, bad)
    if r.weight_sync not in WEIGHT_SYNC_MODES:
        bad("rollout.weight_sync", f"must be one of {list(WEIGHT_SYNC_MODES)}")
    if r.weight_sync_bucket_mb < 0:
        bad("rollout.weight_sync_bucket_mb", "must be >= 0 (0: one broadcast per tensor)")
    if r.weight_sync_backend not in (None, "gloo", "nccl"):
        bad("rollout.weight_sync_backend", "must be gloo, nccl or null (gloo on CPU, nccl on CUDA)")
    check_fleet(cfg, bad)
    if r.mem_fraction_static is not None and not 0 < r.mem_fraction_static < 1:
        bad("rollout.mem_fraction_static", "must be in (0, 1) (or null)")
    positive_reals = (
        "trainer.lr",
        "trainer.clip_grad",
        "trainer.clip_eps",
        "trainer.clip_eps_high",
        "model.rope_theta",
        "model.rms_norm_eps",
    )
    for key in positive_reals:
        value = value_at(cfg, key)
        if not (math.isfinite(value) and value > 0):
            bad(key, "must be a positive finite number")
    for key in ("trainer.weight_decay", "trainer.kl_coef", "model.init_std"):
        value = value_at(cfg, key)
        if not (math.isfinite(value) and value >= 0):
            bad(key, "must be a finite number >= 0")
