"""Rules of the task's keys (`task.*`); whether a task is multi-turn is its registry entry's to say
(tonpolicy.rl.task). Called by tonpolicy.validation.validate with its `bad(key, rule)` reporter."""

from __future__ import annotations

import math
from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.rl.task import TASKS, get_task
from tonpolicy.validation.tokenizer_rules import check_model_tokenizer


def check_task(cfg: Config, bad: Any) -> None:
    task = cfg.task
    check_model_tokenizer(cfg, bad)  # whether a task's prompts read as the model's tokenizer reads them
    if task.graded_tokens < 1:
        bad("task.graded_tokens", "must be a positive integer (the reward grades that many response tokens)")
    elif task.graded_tokens > cfg.experiment.max_new_tokens >= 1:
        bad(
            "task.graded_tokens",
            f"grades more tokens than experiment.max_new_tokens={cfg.experiment.max_new_tokens} "
            "lets a response have (the reward could never reach 1): raise experiment.max_new_tokens to "
            f"{task.graded_tokens} or lower task.graded_tokens",
        )
    multi_turn = task.name in TASKS and get_task(task.name).multi_turn
    if task.max_turns < 1 or (task.max_turns > 1 and not multi_turn):
        bad("task.max_turns", f"must be 1 for the single-turn task {task.name} (>= 1 for a multi-turn task)")
    if multi_turn and cfg.model.is_moe:
        bad("task.name", f"the multi-turn task {task.name} runs a dense model (MoE routes are not kept across turns)")
    if not 0 <= task.target_digit <= 9:
        bad("task.target_digit", "must be a digit in [0, 9]")
    if task.lr is not None and not (math.isfinite(task.lr) and task.lr > 0):
        bad("task.lr", "must be a positive finite number (or null: trainer.lr)")
    if task.max_digits is not None and task.max_digits < 1:
        bad("task.max_digits", "must be a positive integer (or null: as many as experiment.max_prompt_len allows)")
    elif task.max_digits is not None and task.max_digits + 2 > cfg.experiment.max_prompt_len:
        bad(
            "task.max_digits",
            f"a prompt of {task.max_digits} digits and two words exceeds "
            f"experiment.max_prompt_len={cfg.experiment.max_prompt_len}",
        )
