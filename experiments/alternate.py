"""How every benchmark here compares variants on a shared machine: each round measures every variant back
to back, forward on even rounds and backward on odd ones (A/B/C, then C/B/A), so drift over the run hits
all alike; a ratio is the median over rounds of each round's own ratio, so it only ever compares two
measurements taken side by side. Also the per-call timer the microbenchmarks share."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def alternate(
    variants: Sequence[str],
    rounds: int,
    measure: Callable[[str, int], T],
    after_round: Callable[[int, dict[str, T]], None] | None = None,
) -> list[dict[str, T]]:
    """One dict per round, variant -> `measure(variant, round)`; `after_round(round, that dict)` runs as each
    round ends (a progress line). The dicts keep `variants`' order whatever order the round ran in."""
    out: list[dict[str, T]] = []
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        got = {v: measure(v, r) for v in order}
        out.append({v: got[v] for v in variants})
        if after_round is not None:
            after_round(r, out[-1])
    return out


def _identity(x: Any) -> float:
    return x


def per_variant(rounds: list[dict[str, Any]], value: Callable[[Any], float] = _identity) -> dict[str, list[float]]:
    """variant -> its measurements, one per round (through `value`, for measurements that are records)."""
    return {v: [value(r[v]) for r in rounds] for v in rounds[0]} if rounds else {}


def median_of(rounds: list[dict[str, Any]], variant: str, value: Callable[[Any], float] = _identity) -> float:
    """The median over rounds of one variant's measurement."""
    return statistics.median(value(r[variant]) for r in rounds)


def round_ratios(
    rounds: list[dict[str, Any]], num: str, den: str, value: Callable[[Any], float] = _identity
) -> list[float]:
    """Each round's own `num` / `den`."""
    return [value(r[num]) / value(r[den]) for r in rounds]


def median_ratio(rounds: list[dict[str, Any]], num: str, den: str, value: Callable[[Any], float] = _identity) -> float:
    """The median over rounds of each round's own `num` / `den`."""
    return statistics.median(round_ratios(rounds, num, den, value))


def calls_for(fn: Callable[[], object], min_s: float) -> int:
    """How many calls of `fn` take about `min_s` (at least one), from one timed call after a warm-up call."""
    fn()
    t0 = time.perf_counter()
    fn()
    return max(1, int(min_s / max(time.perf_counter() - t0, 1e-7)))


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    """The mean seconds of `calls` calls of `fn` in a row."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def compare_calls(fns: dict[str, Callable[[], object]], rounds: int, min_s: float) -> list[dict[str, float]]:
    """Seconds per call of each function, alternated over `rounds`, each timed over about `min_s` a round."""
    calls = {name: calls_for(fn, min_s) for name, fn in fns.items()}
    return alternate(list(fns), rounds, lambda name, _r: seconds_per_call(fns[name], calls[name]))
