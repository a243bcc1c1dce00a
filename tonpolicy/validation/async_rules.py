"""Rules of asynchronous steps (experiment.max_staleness) and their correction (trainer.tis_cap). Called
by tonpolicy.validation.validate with its `bad(key, rule)` reporter."""

from __future__ import annotations

import math
from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.rl.task import TASKS, get_task


def check_staleness(cfg: Config, bad: Any) -> None:
    k, t = cfg.experiment.max_staleness, cfg.trainer
    if t.tis_cap is not None and not (math.isfinite(t.tis_cap) and t.tis_cap >= 1):
        bad("trainer.tis_cap", "must be a finite number >= 1 (the largest importance weight kept), or null for none")
    if k < 0:
        bad(
            "experiment.max_staleness",
            "must be >= 0 (0: synchronous steps; k: a sample may be at most k policy versions older than "
            "the weights it trains)",
        )
        return
    if k == 0:
        return
    # What asynchronous steps do not support yet: each refusal says why.
    if cfg.task.name in TASKS and get_task(cfg.task.name).multi_turn:
        bad(
            "experiment.max_staleness",
            f"task {cfg.task.name} is multi-turn: the check under each token's sampling version does not "
            "yet skip the environment's tokens (use 0)",
        )
    if cfg.model.is_moe:
        bad(
            "experiment.max_staleness",
            "an MoE model's routes are recorded and compared for the current weights only: asynchronous "
            "steps run dense models (use 0)",
        )
    if t.recompute_logprobs is False:
        bad(
            "trainer.recompute_logprobs",
            f"experiment.max_staleness={k} computes the current policy's (proximal) logprobs before each "
            "update, as decoupled PPO needs: leave it null (or true)",
        )
