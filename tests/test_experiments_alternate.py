"""experiments/alternate.py, the one way every benchmark compares variants: each round runs them all, forward
then backward, and a ratio is the median of the rounds' own ratios (not a ratio of medians)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _alternate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("alternate", ROOT / "experiments" / "alternate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_run_forward_then_backward_and_keep_the_variants_order() -> None:
    alt = _alternate()
    ran: list[tuple[str, int]] = []
    seen: list[int] = []
    rounds = alt.alternate(["a", "b", "c"], 3, lambda v, r: ran.append((v, r)) or len(ran), lambda r, _: seen.append(r))
    assert [v for v, _ in ran] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [list(r) for r in rounds] == [["a", "b", "c"]] * 3
    assert rounds[1] == {"a": 6, "b": 5, "c": 4} and seen == [0, 1, 2]
    assert alt.per_variant(rounds) == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}


def test_a_ratio_is_the_median_of_each_rounds_own_ratio() -> None:
    alt = _alternate()
    # Drift doubles both sides in the last round: the rounds' own ratios stay 2, a ratio of medians would not.
    rounds = [{"x": 2.0, "y": 1.0}, {"x": 4.0, "y": 2.0}, {"x": 40.0, "y": 20.0}, {"x": 2.0, "y": 4.0}]
    assert alt.round_ratios(rounds, "x", "y") == [2.0, 2.0, 2.0, 0.5]
    assert alt.median_ratio(rounds, "x", "y") == 2.0
    assert alt.median_of(rounds, "y") == 3.0
    pairs = [{"x": (1.0, 9.0), "y": (2.0, 3.0)}]
    assert alt.median_ratio(pairs, "x", "y", lambda m: m[1]) == 3.0


def test_compare_calls_times_every_function_each_round() -> None:
    alt = _alternate()
    calls = {"f": 0, "g": 0}

    def bump(name: str) -> None:
        calls[name] += 1

    rounds = alt.compare_calls({"f": lambda: bump("f"), "g": lambda: bump("g")}, 2, 0.0)
    assert len(rounds) == 2 and all(set(r) == {"f", "g"} and min(r.values()) > 0 for r in rounds)
    assert calls["f"] >= 4 and calls["g"] >= 4  # two calls to size the run, then one a round at least
