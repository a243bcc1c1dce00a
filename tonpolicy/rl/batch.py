"""What a step's batch is drawn from: the task's prompts (each repeated for its GRPO group) and the
sampling parameters, a seed per sample. The batch itself is `tonpolicy.loop.rollout_batch.Batch`."""

from __future__ import annotations

from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.rl.task import EOS, make_prompts


def step_prompts(cfg: Config, step: int) -> list[list[int]]:
    """The step's prompts, each repeated `samples_per_prompt` times (a GRPO group is consecutive)."""
    e, t = cfg.experiment, cfg.task
    prompts = make_prompts(
        t.name,
        step,
        e.prompts_per_step,
        seed=e.seed,
        max_prompt_len=e.max_prompt_len,
        target=t.target_digit,
        max_digits=t.max_digits,
    )
    return [p for p in prompts for _ in range(e.samples_per_prompt)]


def sampling_seed(seed: int, step: int, index: int) -> int:
    """Sample `index` of step `step`: its own seed, so every sample is reproducible on its own."""
    return seed * 1_000_003 + step * 10_007 + index


def sampling_params(cfg: Config, seed: int, stop_ids: tuple[int, ...] = (EOS,)) -> dict[str, Any]:
    """One sample's SGLang sampling parameters; `stop_ids` end a response (the built-in tasks' <eos>, or
    the checkpoint's end-of-response ids for the user's prompts)."""
    e = cfg.experiment
    return {
        "temperature": e.temperature,
        "top_p": e.top_p,
        "top_k": e.top_k,
        "max_new_tokens": e.max_new_tokens,
        "stop_token_ids": list(stop_ids),
        "sampling_seed": seed,
    }
