"""A reward function the user names (`reward.function=package.module:function` or `path/to/file.py:function`,
or a built-in's name: tonpolicy.rl.rewards).

This is the one place user code runs, and only where the user names it, as in verl's
custom_reward_function or slime's --custom-rm-path. The function is called per sample with the
keyword arguments its signature accepts (all of them with **kwargs):

    prompt, response        decoded text (None when the checkpoint has no tokenizer)
    prompt_ids, response_ids token ids
    label, extra            the sample's label and other columns (None and {} for a built-in task)

and returns a number. With reward.batched=true it is called once per step with the same names in the
plural (prompts, responses, prompt_ids, response_ids, labels, extras) and returns one number per sample.
A call that raises, runs past reward.timeout_s, or returns something that is not a finite number is
counted (`reward_errors` in the step record) and scores 0.0, or fails the step with reward.on_error=fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as CallTimeout
from pathlib import Path
from typing import Any

from tonpolicy.rl.rewards import BUILTIN

log = logging.getLogger(__name__)

NAMES = ("prompt", "response", "prompt_ids", "response_ids", "label", "extra")
PLURAL = {"prompt": "prompts", "response": "responses", "prompt_ids": "prompt_ids", "response_ids": "response_ids"}
PLURAL |= {"label": "labels", "extra": "extras"}


class RewardError(RuntimeError):
    """The user's reward function could not be loaded, or failed with reward.on_error=fail."""


def load_function(spec: str) -> Callable[..., Any]:
    """A built-in's name (tonpolicy.rl.rewards), `package.module:function`, or `path/to/file.py:function`
    (relative to the working directory)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise RewardError(
            f"reward.function={spec!r}: must be a built-in ({', '.join(BUILTIN)}), 'package.module:function' "
            "or 'path/to/file.py:function'"
        )
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            module_spec = importlib.util.spec_from_file_location(f"tonpolicy_user_reward_{path.stem}", path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise RewardError(f"reward.function={spec!r}: no Python file {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is theirs to read
        raise RewardError(f"reward.function={spec!r}: importing {where} failed: {exc!r}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward.function={spec!r}: {where} has no function {name!r}")
    return fn


def _accepted(fn: Callable[..., Any], names: Sequence[str]) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return list(names)
    return [n for n in names if n in {p.name for p in params}]


def _score(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}, not a finite number")
    return float(value)


class UserReward:
    def __init__(
        self,
        spec: str,
        *,
        timeout_s: float,
        on_error: str,
        batched: bool,
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        self.spec, self.fn = spec, load_function(spec)
        self.timeout_s, self.on_error, self.batched, self.decode = timeout_s, on_error, batched, decode
        names = [PLURAL[n] for n in NAMES] if batched else list(NAMES)
        self.names = _accepted(self.fn, names)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tonpolicy-reward")

    def _call(self, kwargs: dict[str, Any]) -> Any:
        future = self.pool.submit(self.fn, **{k: v for k, v in kwargs.items() if k in self.names})
        try:
            return future.result(timeout=self.timeout_s)
        except CallTimeout:
            # The stuck call keeps its thread; later calls get a fresh one.
            self.pool.shutdown(wait=False)
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="tonpolicy-reward")
            raise TimeoutError(f"ran past reward.timeout_s={self.timeout_s:g}") from None

    def _failed(self, what: str, exc: BaseException) -> None:
        if self.on_error == "fail":
            raise RewardError(f"reward.function={self.spec!r} failed on {what}: {exc!r}") from exc
        log.warning(f"tonpolicy: reward.function {self.spec} failed on {what}: {exc!r} (scored 0.0)")

    def __call__(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        labels: list[Any] | None = None,
        extras: list[dict[str, Any]] | None = None,
    ) -> tuple[list[float], int]:
        """Each sample's reward, and how many calls failed."""
        labels = labels if labels is not None else [None] * len(prompts)
        extras = extras if extras is not None else [{} for _ in prompts]
        decode = self.decode or (lambda ids: None)
        texts = [(decode(p), decode(r)) for p, r in zip(prompts, responses, strict=True)]
        rows = [
            {"prompt": t[0], "response": t[1], "prompt_ids": p, "response_ids": r, "label": lab, "extra": ex}
            for t, p, r, lab, ex in zip(texts, prompts, responses, labels, extras, strict=True)
        ]
        if self.batched:
            try:
                values = self._call({PLURAL[n]: [row[n] for row in rows] for n in NAMES})
                if not isinstance(values, Sequence) or len(values) != len(rows):
                    raise TypeError(f"returned {type(values).__name__}, not one number per sample ({len(rows)})")
                return [_score(v) for v in values], 0
            except Exception as exc:  # noqa: BLE001 - the user's code
                self._failed(f"a batch of {len(rows)} samples", exc)
                return [0.0] * len(rows), len(rows)
        rewards, errors = [], 0
        for i, row in enumerate(rows):
            try:
                rewards.append(_score(self._call(row)))
            except Exception as exc:  # noqa: BLE001 - the user's code
                self._failed(f"sample {i}", exc)
                rewards.append(0.0)
                errors += 1
        return rewards, errors
