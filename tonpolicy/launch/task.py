"""The built-in task with a verifiable reward: copy the prompt's digits.

Token ids stand for themselves (the embedded model has no tokenizer): ids DIGIT0..DIGIT0+9 are the
digits. A prompt is `COPY d1 .. dn SEP`; the reward of a response is the fraction of the first n
response tokens whose id is congruent to the target digit modulo 10, so even an untrained model
gets graded, non-constant rewards and GRPO has advantages to work with.
"""

from __future__ import annotations

import random

COPY, SEP, EOS, DIGIT0 = 3, 4, 2, 10


def make_prompts(step: int, count: int, *, seed: int, max_prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + step)
    prompts = []
    for _ in range(count):
        n = rng.randint(1, max(1, max_prompt_len - 2))
        prompts.append([COPY, *(DIGIT0 + rng.randrange(10) for _ in range(n)), SEP])
    return prompts


def reward(prompt: list[int], response: list[int]) -> float:
    target = [t - DIGIT0 for t in prompt[1:-1]]
    if not target:
        return 0.0
    hits = sum(1 for t, r in zip(target, response, strict=False) if r % 10 == t)
    return hits / len(target)
