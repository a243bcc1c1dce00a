"""One background thread owns the engine; HTTP handler threads hand it work through a queue.

Concurrent /generate requests are coalesced: the loop takes every request waiting at that moment
and runs them as one `engine.generate` batch (the engine batches them continuously inside). Work
that must not overlap a batch (weight reload, cache flush) runs on the same thread, between batches,
in arrival order, so a request sent after a weight update is answered with the new weights.
`tag` (the weight version) is read on the loop thread when a batch runs and returned with it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BatchResult:
    results: list[Any]  # engine results, in request order
    tag: Any  # EngineLoop.tag when the batch ran


@dataclass
class _Job:
    requests: Sequence[Any] | None  # GenRequests for a generate job, None for a call
    fn: Callable[[Any], Any] | None  # called with the engine, on the loop thread
    future: Future = field(default_factory=Future)


class EngineLoop:
    def __init__(self, engine: Any, *, batch_wait_s: float = 0.005) -> None:
        self.engine = engine
        # A short wait lets requests sent together by concurrent clients land in one batch.
        self.batch_wait_s = batch_wait_s
        self.tag: Any = None  # set it from a `call` to keep it in step with the batches
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tonpolicy-engine-loop", daemon=True)
        self.batches_run = 0
        self.requests_run = 0
        self.largest_batch = 0
        self.error: BaseException | None = None  # set when the loop itself died

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def generate(self, requests: Sequence[Any]) -> Future:
        """Future of a BatchResult: `engine.generate(requests)` results, in the same order."""
        return self._submit(_Job(list(requests), None))

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Future of `fn(engine)`, run between batches."""
        return self._submit(_Job(None, fn))

    def _submit(self, job: _Job) -> Future:
        if not self.is_alive():
            job.future.set_exception(RuntimeError("the engine loop is not running"))
        else:
            self._queue.put(job)
        return job.future

    def _run(self) -> None:
        pending: deque[_Job | None] = deque()
        try:
            while True:
                job = pending.popleft() if pending else self._queue.get()
                if job is None:
                    break
                if job.fn is not None:
                    self._run_call(job)
                    continue
                batch = [job]
                if self.batch_wait_s > 0:
                    time.sleep(self.batch_wait_s)
                while True:  # take everything waiting; a call waits until this batch is done
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None or nxt.fn is not None:
                        pending.append(nxt)
                        break
                    batch.append(nxt)
                self._run_batch(batch)
        except BaseException as e:  # noqa: BLE001 - record why the loop died for /health
            self.error = e
            raise
        finally:
            self._fail_waiting(pending)

    def _run_call(self, job: _Job) -> None:
        try:
            job.future.set_result(job.fn(self.engine))
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            job.future.set_exception(e)

    def _run_batch(self, batch: list[_Job]) -> None:
        flat = [r for job in batch for r in job.requests]
        if not flat:
            for job in batch:
                job.future.set_result(BatchResult([], self.tag))
            return
        try:
            results = self.engine.generate(flat)
            if len(results) != len(flat):
                raise RuntimeError(f"engine returned {len(results)} results for {len(flat)} requests")
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
            for job in batch:
                job.future.set_exception(e)
            return
        self.batches_run += 1
        self.requests_run += len(flat)
        self.largest_batch = max(self.largest_batch, len(flat))
        start = 0
        for job in batch:
            n = len(job.requests)
            job.future.set_result(BatchResult(list(results[start : start + n]), self.tag))
            start += n

    def _fail_waiting(self, pending: deque[_Job | None]) -> None:
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            if job is not None and not job.future.done():
                job.future.set_exception(RuntimeError("the engine loop stopped"))
