"""The built-in rewards (reward.function=exact_match | math_answer) score decoded text against the row's
label the way their names say, through the same per-sample containment as a user's function: a sample
without a label or without text is counted, not a crash."""

from __future__ import annotations

import pytest

from tonpolicy.rl.rewards import CHOICE_CREDIT, choice_match, exact_match, math_answer
from tonpolicy.rl.user_reward import UserReward, load_function


def test_exact_match_compares_normalized_text_with_any_accepted_label() -> None:
    assert exact_match("  Paris \n", "Paris") == 1.0
    assert exact_match("New   York", ["Boston", "New York"]) == 1.0
    assert exact_match("paris", "Paris") == 0.0  # case is part of the answer
    assert exact_match("Paris, France", "Paris") == 0.0


def test_choice_match_credits_the_label_fully_and_another_allowed_answer_a_little() -> None:
    row = {"choices": ["even", "odd"]}
    assert choice_match(" odd", "odd", row) == 1.0
    assert choice_match("even\n", "odd", row) == CHOICE_CREDIT  # the format, not the answer
    assert 0.0 < CHOICE_CREDIT < 1.0
    assert choice_match("od", "odd", row) == 0.0 and choice_match("Odd", "odd", row) == 0.0
    assert choice_match("odd", "odd") == 1.0  # the label alone needs no choices
    with pytest.raises(ValueError, match="'choices' column"):
        choice_match("even", "odd", {})
    # named by its module path, it receives the row's other columns as `extra`
    reward = UserReward("tonpolicy.rl.rewards:choice_match", timeout_s=30, on_error="zero", batched=False, decode=str)
    assert reward([[1], [1]], [[2], [3]], ["[2]", "[2]"], [{"choices": ["[2]", "[3]"]}] * 2) == (
        [1.0, CHOICE_CREDIT],
        0,
    )


def test_math_answer_is_equality_of_the_mathematics_not_of_the_text() -> None:
    assert math_answer("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("The result: $x + 1$", "1 + x") == 1.0
    assert math_answer("the answer is \\boxed{3}", ["2", "3"]) == 1.0
    assert math_answer("the answer is \\boxed{0.49}", "1/2") == 0.0
    assert math_answer("no number here", "7") == 0.0


def test_built_ins_are_named_like_a_users_function_and_their_failures_are_counted() -> None:
    assert (
        load_function("exact_match") is exact_match and load_function("tonpolicy.rl.rewards:math_answer") is math_answer
    )
    words = {1: "4", 2: "\\boxed{4}", 3: "five"}
    reward = UserReward(
        "math_answer", timeout_s=30, on_error="zero", batched=False, decode=lambda ids: " ".join(words[i] for i in ids)
    )
    rewards, errors = reward([[1], [1], [1], [1]], [[2], [3], [2], [2]], ["4", "4", None, "not $ math {"])
    assert rewards == [1.0, 0.0, 0.0, 0.0] and errors == 2  # no label; a label that is not mathematics
    no_text = UserReward("exact_match", timeout_s=30, on_error="fail", batched=False, decode=None)
    with pytest.raises(RuntimeError, match="needs the decoded response"):
        no_text([[1]], [[2]], ["4"])
