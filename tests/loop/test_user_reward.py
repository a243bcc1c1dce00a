"""The user's reward function: found by import path or file path, called with the arguments its
signature names, per sample or batched; a call that raises, hangs or returns no finite number is
counted and scores 0.0 (or fails with reward.on_error=fail); a bad reward.function is refused before
anything starts, naming the key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tonpolicy.app import run
from tonpolicy.config.compose import compose_config
from tonpolicy.rl.user_reward import RewardError, UserReward, load_function
from tonpolicy.validation.validate import ConfigError

USER_CODE = """
import math, time

def by_length(response_ids):
    return float(len(response_ids))

def text_and_label(prompt, response, label, extra):
    return 1.0 if response == prompt.upper() and label is None and extra == {} else 0.0

def anything(**kwargs):
    return float(sorted(kwargs) == ["extra", "label", "prompt", "prompt_ids", "response", "response_ids"])

def flaky(response_ids):
    if response_ids[0] == 1:
        raise ValueError("no ones")
    if response_ids[0] == 2:
        return math.nan
    if response_ids[0] == 3:
        time.sleep(5)
    if response_ids[0] == 4:
        return "four"
    return 1.0

def batch(response_ids, labels):
    return [float(len(r)) for r in response_ids] if labels == [None] * len(response_ids) else []

def batch_too_short(responses):
    return [1.0]
"""


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    return str(path)


def _reward(spec: str, **kw: object) -> UserReward:
    opts: dict = {"timeout_s": 1.0, "on_error": "zero", "batched": False, "decode": None, **kw}
    return UserReward(spec, **opts)


def test_called_with_what_the_signature_names(user_file: str) -> None:
    assert _reward(f"{user_file}:by_length")([[9], [9]], [[5, 6], [7]]) == ([2.0, 1.0], 0)
    upper = _reward(f"{user_file}:text_and_label", decode=lambda ids: "".join(chr(96 + i) for i in ids))
    assert upper([[1, 2]], [[1, 2]]) == ([0.0], 0)  # "ab" != "AB"
    assert _reward(f"{user_file}:anything")([[1]], [[2]]) == ([1.0], 0)
    assert _reward(f"{user_file}:batch", batched=True)([[1], [1]], [[5, 6, 7], [8]]) == ([3.0, 1.0], 0)
    assert load_function("math:sqrt")(4.0) == 2.0  # a module path


def test_failures_are_contained_and_counted(user_file: str) -> None:
    t0 = time.monotonic()
    rewards, failed = _reward(f"{user_file}:flaky")([[0]] * 5, [[1], [2], [3], [4], [5]])
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0] and failed == 4
    assert time.monotonic() - t0 < 4  # the hung call was abandoned at reward.timeout_s
    assert _reward(f"{user_file}:batch_too_short", batched=True)([[1], [1]], [[2], [3]]) == ([0.0, 0.0], 2)
    with pytest.raises(RewardError, match="failed on sample 0: ValueError"):
        _reward(f"{user_file}:flaky", on_error="fail")([[0]], [[1]])


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_colon", "must be a built-in (exact_match, choice_match, math_answer), 'package.module:function'"),
        ("/nonexistent/r.py:f", "no Python file /nonexistent/r.py"),
        ("tonpolicy_no_such_module:f", "importing tonpolicy_no_such_module failed"),
        ("math:no_such_function", "math has no function 'no_such_function'"),
    ],
)
def test_a_bad_reward_function_is_refused_before_start(tmp_path: Path, spec: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        run(compose_config([f"reward.function={spec}", "logger=none"]), tmp_path / "run")
    assert f"reward.function={spec!r}: " in str(e.value) and says in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written, nothing started
