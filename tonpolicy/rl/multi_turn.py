"""Multi-turn tasks: the model answers, the environment replies with tokens of its own, for up to
`task.max_turns` model turns; the reward grades the final turn.

Token in, token out: each turn's request is the previous context's token ids, the ids the server
sampled and the environment's ids, concatenated; nothing is decoded to text and re-encoded in
between (a re-tokenising client would hand the trainer ids the rollout never sampled:
tests/loop/test_multi_turn.py shows one with the project's tokenizer). A sample's response is every
token after its prompt; its mask says whose each token is (True: the model's, scored by the gate and
the loss; False: the environment's, in the context only). The rollout has logprobs only for the
model's tokens: the environment's are 0.0 (finite, so a masked-out loss term stays exactly 0; a
comparison that forgot the mask would find them differing from the trainer's negative logprobs).

Each multi-turn task's environment is a field of its `Task` (tonpolicy.rl.task).
The calculator (`task=calculator`): prompt `add a b :`. After each model turn but the last, the
environment replies `= s` with s = (a + b) mod 10 (the tool's result). The final turn's first token
must be s (by id modulo 10): read from the environment's reply, the token it is predicted at, it is
echo_digit's task; from the prompt alone it is a sum of two earlier digits, which the tiny policy does
not learn, so a policy that ignored the environment's tokens would stay near chance. Every episode has max_turns
model turns, so every sample is multi-turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tonpolicy.config.sizes import MAX_ENV_REPLY_TOKENS
from tonpolicy.rl.task import calculator_reply as calculator_reply  # the calculator's environment
from tonpolicy.rl.task import get_task


def is_multi_turn(task: str) -> bool:
    return get_task(task).multi_turn


@dataclass
class Episode:
    """One sample's conversation, as token ids: the prompt, then model and environment turns."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[bool] = field(default_factory=list)  # per response token: True = the model's
    logprobs: list[float] = field(default_factory=list)  # the rollout's; 0.0 at the environment's tokens
    versions: list[str | None] = field(default_factory=list)  # the weight version that sampled it; env: None
    turns: list[list[int]] = field(default_factory=list)  # the model's turns
    cached_tokens: int = 0  # context tokens the server reused from its prefix cache, over all turns

    @property
    def context(self) -> list[int]:
        """What the next turn's request sends: token ids, exactly as sampled and replied."""
        return [*self.prompt, *self.response]

    def add_model_turn(self, ids: list[int], logprobs: list[float], versions: list[str | None] | None = None) -> None:
        versions = [None] * len(ids) if versions is None else versions
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"a turn of {len(ids)} tokens came with {len(logprobs)} logprobs, {len(versions)} versions"
            )
        self.turns.append(list(ids))
        self.response += ids
        self.mask += [True] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_env_turn(self, ids: list[int]) -> None:
        if len(ids) > MAX_ENV_REPLY_TOKENS:
            raise ValueError(f"an environment reply of {len(ids)} tokens exceeds {MAX_ENV_REPLY_TOKENS}")
        self.response += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)


def run_episodes(
    task: str,
    prompts: list[list[int]],
    max_turns: int,
    generate: Callable[[list[list[int]], int], list[dict[str, Any]]],
) -> list[Episode]:
    """Every prompt's episode. `generate(contexts, turn)`: one batched request per turn (the rollout
    client's outputs: output_ids, output_logprobs, cached_tokens), all episodes advancing together."""
    reply = get_task(task).environment
    assert reply is not None, f"task {task} has no environment"
    episodes = [Episode(list(p)) for p in prompts]
    for turn in range(max_turns):
        outs = generate([e.context for e in episodes], turn)
        for e, o in zip(episodes, outs, strict=True):
            ids, logprobs = [int(t) for t in o["output_ids"]], [float(x) for x in o["output_logprobs"]]
            e.add_model_turn(ids, logprobs, o.get("weight_versions"))
            e.cached_tokens += int(o.get("cached_tokens") or 0)
            if turn + 1 < max_turns:
                e.add_env_turn(reply(e.prompt, e.turns[-1]))
    return episodes


def segments(response: list[int], mask: list[bool]) -> list[tuple[str, list[int]]]:
    """The response as (who, ids) runs: 'model' or 'env', for samples.jsonl and W&B."""
    out: list[tuple[str, list[int]]] = []
    for t, m in zip(response, mask, strict=True):
        who = "model" if m else "env"
        if out and out[-1][0] == who:
            out[-1][1].append(t)
        else:
            out.append((who, [t]))
    return out
