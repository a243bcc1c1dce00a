"""Built-in tasks with verifiable rewards (the `task` config group), over the tiny model's vocabulary.

Token ids and their text (tonpolicy.model.tokenizer): 0 <pad>, 1 <bos>, 2 <eos>, 3 copy, 4 ":",
5 first, 6 say, 7 add, 8 call, 9 "=" (the multi-turn calculator's, tonpolicy.rl.multi_turn), 10..19 the
digits 0..9, every other id a placeholder <tN>. Rewards are graded over
the first `graded_tokens` response tokens and count a token by its id modulo 10 (modulo 2 for parity),
so an untrained model already scores at chance and GRPO has advantages to work with:
- first_parity: `first d :` -> a token whose id has d's parity. The default run's task: prompt-
  conditioned through attention (the answer is predicted at ':', after the digit). Measured in the
  default run (24 steps of 16 prompts x 8 one-token answers from the top 16, lr 1.5e-2; 2-core Intel
  Xeon with AMX): reward, mean of the first 3 steps -> last 3, 0.49 -> 1.00 (seed 0, first 1.00 at step
  15 of 0-23), 0.57 -> 0.91 (seed 1), 0.50 -> 1.00 (seed 2), 0.47 -> 1.00 with torch held to AVX2 (seed
  0), right for even and odd digits alike. With 4 answers a prompt a run learnt or collapsed onto a few
  tokens by the CPU's bf16 backward bits (2 of 6 seeds learnt on that Xeon). `task.max_digits` > 1 makes
  it harder;
- constant: `say :` -> the target digit every time (sanity: 0.16 -> 1.0 in about 12 steps);
- echo_digit: `say d` -> d (no attention needed: 0.22 -> 0.63 in 24 steps);
- first_digit: `first d1 .. dn :` -> d1 (10 classes through attention: 0.12 -> ~0.2 in 24 steps);
- digit_copy: `copy d1 .. dn :` -> d1 .. dn (out of reach for a random-init model in a CPU run).
Sampling the whole vocabulary (top_k off), none of the prompt-conditioned tasks was learnt within
40-60 steps: a reward spread over ~200 random tokens per class barely reinforces any one of them.
A registry of `Task`s (`TASKS`, `register_task`), chosen by name: nothing from the config is imported or
instantiated.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

PAD, BOS, EOS, COPY, SEP, FIRST, SAY, ADD, CALL, RESULT, DIGIT0 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
WORDS = {
    PAD: "<pad>",
    BOS: "<bos>",
    EOS: "<eos>",
    COPY: "copy",
    SEP: ":",
    FIRST: "first",
    SAY: "say",
    ADD: "add",
    CALL: "call",
    RESULT: "=",
}


def _digits(rng: random.Random, max_digits: int) -> list[int]:
    return [DIGIT0 + rng.randrange(10) for _ in range(rng.randint(1, max(1, max_digits)))]


def _graded(targets: list[int], response: list[int], graded_tokens: int, classes: int = 10) -> float:
    """Fraction of the first `graded_tokens` targets that the response matches (ids modulo `classes`)."""
    targets = targets[:graded_tokens]
    if not targets:
        return 0.0
    return sum(1 for t, r in zip(targets, response, strict=False) if r % classes == t % classes) / len(targets)


def first_digit_prompt(rng: random.Random, max_digits: int, target: int) -> list[int]:
    return [FIRST, *_digits(rng, max_digits), SEP]


def first_digit_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    return _graded([prompt[1]] * graded, response, graded)


def copy_prompt(rng: random.Random, max_digits: int, target: int) -> list[int]:
    return [COPY, *_digits(rng, max_digits), SEP]


def copy_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    return _graded(prompt[1:-1], response, graded)


def constant_prompt(rng: random.Random, max_digits: int, target: int) -> list[int]:
    return [SAY, SEP]


def constant_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    return _graded([DIGIT0 + target] * graded, response, graded)


def echo_prompt(rng: random.Random, max_digits: int, target: int) -> list[int]:
    return [SAY, DIGIT0 + rng.randrange(10)]


def echo_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    return _graded([prompt[-1]] * graded, response, graded)


def first_parity_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    return _graded([prompt[1]] * graded, response, graded, classes=2)


def calculator_prompt(rng: random.Random, max_digits: int, target: int) -> list[int]:
    return [ADD, DIGIT0 + rng.randrange(10), DIGIT0 + rng.randrange(10), SEP]


def calculator_sum(prompt: list[int]) -> int:
    """What `add a b :` asks for: (a + b) mod 10, the calculator tool's answer."""
    return (prompt[1] + prompt[2] - 2 * DIGIT0) % 10


def calculator_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    """`response`: the final model turn. Its first token must be (a + b) mod 10 (by id modulo 10): the
    tool's result, the token the answer is predicted at, makes it echo_digit's task; without it, a sum."""
    return _graded([DIGIT0 + calculator_sum(prompt)] * graded, response, graded)


def calculator_reply(prompt: list[int], turn: list[int]) -> list[int]:
    """The calculator's reply after a model turn: its result `= s`, whatever the turn said. Why always:
    an untrained policy never samples a `call` token among its top 16, so a tool that answered only a
    call never answered and the reward stayed at chance. Why no `:` after s: the next model turn is then
    predicted at s itself (as echo_digit's answer is), not at a `:` that the first turn is also
    predicted at, whose distribution the first turn's noisy updates also move."""
    return [RESULT, DIGIT0 + calculator_sum(prompt)]


Prompt = Callable[[random.Random, int, int], list[int]]  # (rng, max digits, target digit) -> ids
Reward = Callable[[list[int], list[int], int, int], float]  # (prompt, response, graded, target) -> [0, 1]
Environment = Callable[[list[int], list[int]], list[int]]  # (prompt, a model turn's ids) -> reply ids


@dataclass(frozen=True)
class Task:
    """A built-in task, chosen by `task.name`: its prompts, its reward and, for a multi-turn task, the
    environment that replies after each model turn but the last (tonpolicy.rl.multi_turn)."""

    name: str
    prompt: Prompt
    reward: Reward
    environment: Environment | None = None

    @property
    def multi_turn(self) -> bool:
        return self.environment is not None


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add a task: `task.name` then validates, makes prompts and scores them with no other edit."""
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def unregister_task(name: str) -> None:
    TASKS.pop(name, None)


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"task.name={name!r}: unknown task; known: {', '.join(TASKS)}") from None


for _task in (
    Task("echo_digit", echo_prompt, echo_reward),
    Task("first_digit", first_digit_prompt, first_digit_reward),
    Task("first_parity", first_digit_prompt, first_parity_reward),
    Task("digit_copy", copy_prompt, copy_reward),
    Task("constant", constant_prompt, constant_reward),
    Task("calculator", calculator_prompt, calculator_reward, environment=calculator_reply),
):
    register_task(_task)


def make_prompts(
    task: str, step: int, count: int, *, seed: int, max_prompt_len: int, target: int = 0, max_digits: int | None = None
) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + step)
    make = get_task(task).prompt
    digits = max_prompt_len - 2 if max_digits is None else min(max_digits, max_prompt_len - 2)
    return [make(rng, digits, target) for _ in range(count)]


def reward(task: str, prompt: list[int], response: list[int], graded_tokens: int, target: int = 0) -> float:
    return get_task(task).reward(prompt, response, graded_tokens, target)
