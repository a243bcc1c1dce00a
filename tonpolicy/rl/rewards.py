"""Built-in reward functions for the common cases, named by their key in BUILTIN
(`reward.function=exact_match`, `choice_match`, `math_answer`) or as a user's are (`tonpolicy.rl.rewards:<name>`).
They read the decoded response and the row's label (`data.label_key`), so they need the checkpoint's
tokenizer; a label may be a list of accepted answers. exact_match and math_answer score 1.0 or 0.0;
choice_match also gives partial credit for another of the row's allowed answers (a format reward)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any


def exact_match(response: str | None, label: Any) -> float:
    """1.0 when the response, stripped and with runs of whitespace made one space, equals a label so
    normalized (case kept: an answer's case can matter)."""
    got = _normalized(_text(response))
    return float(any(got == _normalized(str(answer)) for answer in _answers(label)))


def math_answer(response: str | None, label: Any) -> float:
    """1.0 when the response's final mathematical answer (a \\boxed{...}, LaTeX or a plain expression)
    equals a label's mathematically, as Hugging Face's math-verify decides (1/2 = 0.5 = \\frac{1}{2})."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise RuntimeError("math_answer needs math-verify: pip install 'tonpolicy[data]'") from exc
    # reward.timeout_s bounds the call; math-verify's own timeouts use SIGALRM, which a worker thread
    # cannot, and say so once per call
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    predicted = parse(_text(response), parsing_timeout=None)
    for answer in _answers(label):
        gold = parse(_as_math(str(answer)), parsing_timeout=None)
        if not gold:
            raise ValueError(f"the label {answer!r} is not a mathematical answer math-verify can read")
        if predicted and verify(gold, predicted, timeout_seconds=None):
            return 1.0
    return 0.0


# Half the label's: the answer word a policy finds second still scores above the group's other samples
# while the first one spreads (a smaller credit left it unsampled: the policy settled on one word).
CHOICE_CREDIT = 0.5


def choice_match(response: str | None, label: Any, extra: dict[str, Any] | None = None) -> float:
    """exact_match, with CHOICE_CREDIT for a response that is another of the row's allowed answers (its
    `choices` column, compared as exact_match compares). Why: with exact_match alone a policy that
    settles on one answer word gets no reward on the other class's prompts, all of whose samples then
    score alike (no GRPO advantage); crediting the format keeps both words sampled, so correctness is
    what separates them."""
    if exact_match(response, label):
        return 1.0
    choices = (extra or {}).get("choices")
    if choices is None:
        raise ValueError("choice_match needs the row's allowed answers: a 'choices' column")
    return CHOICE_CREDIT * exact_match(response, list(choices))


BUILTIN: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "choice_match": choice_match,
    "math_answer": math_answer,
}


def _text(response: str | None) -> str:
    if response is None:
        raise ValueError("a built-in reward needs the decoded response: the checkpoint has no tokenizer.json")
    return response


def _answers(label: Any) -> list[Any]:
    answers = [a for a in (label if isinstance(label, list | tuple) else [label]) if a is not None]
    if not answers:
        raise ValueError("the sample has no label (data.label_key) to compare the response with")
    return answers


def _normalized(text: str) -> str:
    return " ".join(text.split())


def _as_math(answer: str) -> str:
    # a bare label such as "0.5" or "x+1" reads as math; one already in $...$ or \boxed{} is kept
    return answer if "$" in answer or "\\" in answer else f"${answer}$"
