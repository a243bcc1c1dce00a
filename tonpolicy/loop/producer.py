"""Asynchronous steps (experiment.max_staleness=k >= 1): rank 0's generation thread.

Batch j is generated as soon as the servers serve policy version >= j - k (version v: the weights after
v updates, pushed at the end of step v - 1), while the trainer trains the earlier steps. The trainer at
step j holds version j, so every sample it trains is at most k versions old, and at most k + 1 batches
are ever out at once. Pushes come from the main thread between the producer's requests' progress: a
server loads new weights between requests (the embedded server's update waits for the running request;
SGLang's `/update_weights_*` take its model-update lock, which waits for running requests too), so a
request's tokens carry one version, while a fleet's per-sample requests may straddle a push (the batch
then mixes versions, each token labelled by its server).

k = 0 never starts the thread: the synchronous loop generates in the step itself, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ProducerStopped(RuntimeError):
    """`take` after `close`."""


class BatchProducer(Generic[T]):
    """`make(j)` builds batch j (in the thread); `take(j)` hands it over in order; `pushed(v)` tells the
    thread the servers now serve version v; `close()` stops it (a request in flight is left to finish)."""

    def __init__(self, make: Callable[[int], T], steps: int, max_staleness: int, served: int = 0) -> None:
        if max_staleness < 1:
            raise ValueError(f"a producer overlaps steps only with max_staleness >= 1, not {max_staleness}")
        self._make, self._steps, self._k = make, steps, max_staleness
        self._cond = threading.Condition()
        self._served = served
        self._ready: dict[int, T] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self.started: dict[int, int] = {}  # batch j -> the version served when its generation began
        self._thread = threading.Thread(target=self._run, name="tonpolicy-rollout-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for j in range(self._steps):
                with self._cond:
                    self._cond.wait_for(lambda j=j: self._stopped or self._served >= j - self._k)
                    if self._stopped:
                        return
                    self.started[j] = self._served
                batch = self._make(j)
                with self._cond:
                    self._ready[j] = batch
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def pushed(self, version: int) -> None:
        """Every server now serves policy version `version` (its push was acknowledged)."""
        with self._cond:
            self._served = max(self._served, version)
            self._cond.notify_all()

    def take(self, j: int) -> tuple[T, float]:
        """Batch j and the seconds waited for it; re-raises the thread's error (e.g. a server gone)."""
        t0 = time.monotonic()
        with self._cond:
            self._cond.wait_for(lambda: j in self._ready or self._error is not None or self._stopped)
            if j in self._ready:
                return self._ready.pop(j), time.monotonic() - t0
            if self._error is not None:
                raise self._error
            raise ProducerStopped(f"batch {j} was asked for after the producer stopped")

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout_s)  # a daemon: an HTTP request still running ends with the process
