"""Seconds spent inside named ops of a kernel set, for the benches' profiles (bench_engine, bench_rollout)."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def timed_ops(kernels: Any, names: list[str] | tuple[str, ...]) -> Iterator[collections.Counter[str]]:
    """Wrap each named op on this kernel-set instance while the block runs; yields seconds per op name.
    The wrappers live on the instance and are deleted afterwards, so the class methods come back."""
    spent: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t0
            return out

        return run

    for n in names:
        setattr(kernels, n, timed(n, getattr(kernels, n)))
    try:
        yield spent
    finally:
        for n in names:
            delattr(kernels, n)
