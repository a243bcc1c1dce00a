"""One background thread owns the engine; HTTP handler threads hand it work through a queue.

True continuous batching across requests: between engine steps the loop takes every job waiting
and `engine.add`s its requests, so a request sent while others are mid-decode joins the running
batch at the next step instead of waiting for them. Work that must not overlap generation (weight
reload, cache flush) keeps arrival order by pausing admission: a call waits, with every job queued
after it, until the requests already in the engine finish; then it runs and admission resumes. So
a request sent before a weight update is answered with the old weights, one sent after with the new.
`tag` (the weight version) is read on the loop thread when a job's requests are admitted; a call can
only change it while no request is in flight, so it is also the tag they finish under.

The server runs the loop on its main thread (`run`): torch's intra-op OpenMP team belongs to the
thread that made it, and an engine stepping on a second thread ran up to 40% slower at 2 threads
(measured: tiny model, one stream, 175 vs 300 tok/s). `start` runs it on a thread of its own (tests).
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

IDLE_WAKE_S = 0.2  # how often an idle loop returns to the interpreter (for signal handlers)


@dataclass(frozen=True)
class BatchResult:
    results: list[Any]  # engine results, in request order
    tag: Any  # EngineLoop.tag when the requests ran


@dataclass
class _Job:
    requests: Sequence[Any] | None  # GenRequests for a generate job, None for a call
    fn: Callable[[Any], Any] | None  # called with the engine, on the loop thread
    future: Future = field(default_factory=Future)
    results: list[Any] = field(default_factory=list)  # filled as its requests finish
    remaining: int = 0
    tag: Any = None
    # Streaming: called on the loop thread with (request index, result so far) after each step that
    # gave one of the job's requests a token, and with its final result. Must not block.
    on_progress: Callable[[int, Any], None] | None = None
    reported: list[int] = field(default_factory=list)  # tokens already reported, per request


class EngineLoop:
    """Drives an engine with the incremental API: check(req), add(req) -> handle,
    step() -> [(handle, result)], has_work(), abort() -> [handle]."""

    def __init__(self, engine: Any, *, batch_wait_s: float = 0.005) -> None:
        self.engine = engine
        # When the engine is idle, a short wait lets requests sent together by concurrent clients
        # start in the same step; once it runs, later requests join between steps anyway.
        self.batch_wait_s = batch_wait_s
        self.tag: Any = None  # set it from a `call` to keep it in step with the requests
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._alive = threading.Event()  # set from start/run until the loop exits
        self._inflight: dict[int, tuple[_Job, int]] = {}  # engine handle -> (job, request index)
        self.batches_run = 0  # busy periods: the engine went from idle to running requests
        self.requests_run = 0
        self.largest_batch = 0  # most requests in the engine at once
        self.steps_run = 0
        self.error: BaseException | None = None  # set when the loop itself died

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self._alive.set()
        self._thread = threading.Thread(target=self._run, name="tonpolicy-engine-loop", daemon=True)
        self._thread.start()

    def run(self, on_start: Callable[[], None] | None = None) -> None:
        """Run the loop in the calling thread until `request_stop` (or `stop`) is reached; `on_start` is
        called once it accepts work. Raises what killed the loop, if anything did."""
        self._alive.set()
        if on_start is not None:
            on_start()
        self._run()

    def request_stop(self) -> None:
        """Requests submitted before this still finish (it waits like a call), later ones fail."""
        self._queue.put(None)

    def stop(self, timeout_s: float = 10.0) -> None:
        """`request_stop`, then wait for the loop's thread (when `start` made one)."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._alive.is_set()

    def generate(self, requests: Sequence[Any], on_progress: Callable[[int, Any], None] | None = None) -> Future:
        """Future of a BatchResult: the engine's results for `requests`, in the same order.
        `on_progress(i, result_so_far)` streams them (see _Job.on_progress)."""
        return self._submit(_Job(list(requests), None, on_progress=on_progress))

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Future of `fn(engine)`, run once no request is in flight (admission pauses until then)."""
        return self._submit(_Job(None, fn))

    def _submit(self, job: _Job) -> Future:
        if not self.is_alive():
            job.future.set_exception(RuntimeError("the engine loop is not running"))
        else:
            self._queue.put(job)
        return job.future

    def _run(self) -> None:
        pending: deque[_Job | None] = deque()  # taken off the queue, not admitted yet
        try:
            while True:
                self._take(pending)
                if self._admit(pending):
                    break
                if self.engine.has_work():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - record why the loop died for /health
            self.error = e
            raise
        finally:
            self._alive.clear()
            self._fail_waiting(pending)

    def _take(self, pending: deque[_Job | None]) -> None:
        """Move queued jobs to `pending`; block only when there is nothing else to do."""
        if not pending and not self.engine.has_work():
            pending.append(self._wait_for_job())
            if pending[0] is not None and pending[0].fn is None and self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _wait_for_job(self) -> _Job | None:
        """The next job, waiting in short slices: the server runs this loop on its main thread, and a
        SIGTERM the kernel delivers to another thread only runs Python's handler once the main thread
        is back in the interpreter (an untimed wait kept it blocked: the server ignored SIGTERM)."""
        while True:
            try:
                return self._queue.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                continue

    def _admit(self, pending: deque[_Job | None]) -> bool:
        """Add pending jobs to the engine in arrival order, up to the first call (or stop) while
        requests are in flight. True when stop was reached with nothing in flight."""
        while pending:
            job = pending[0]
            if job is None or job.fn is not None:
                if self.engine.has_work():
                    return False  # pause admission: the call runs when in-flight requests finish
                pending.popleft()
                if job is None:
                    return True
                self._run_call(job)
                continue
            pending.popleft()
            self._add_job(job)
        return False

    def _run_call(self, job: _Job) -> None:
        try:
            job.future.set_result(job.fn(self.engine))
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            job.future.set_exception(e)

    def _add_job(self, job: _Job) -> None:
        try:
            for r in job.requests:
                self.engine.check(r)  # all or nothing: one bad request fails only its own job
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            job.future.set_exception(e)
            return
        if not job.requests:
            job.future.set_result(BatchResult([], self.tag))
            return
        if not self.engine.has_work():
            self.batches_run += 1
        job.results, job.remaining, job.tag = [None] * len(job.requests), len(job.requests), self.tag
        job.reported = [0] * len(job.requests)
        for i, r in enumerate(job.requests):
            self._inflight[self.engine.add(r)] = (job, i)
        self.largest_batch = max(self.largest_batch, len(self._inflight))

    def _step(self) -> None:
        try:
            done = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every request in flight gets the error
            self.engine.abort()
            self._fail_inflight(e)
            return
        self.steps_run += 1
        self._report_progress()
        for handle, result in done:
            job, i = self._inflight.pop(handle)
            if job.on_progress is not None and not job.future.done():
                job.on_progress(i, result)
            job.results[i] = result
            job.remaining -= 1
            self.requests_run += 1
            if job.future.done():
                continue  # the job already failed through another of its requests
            if result.finish_reason == "error":
                # Only this request's job fails; its other requests finish and are dropped.
                job.future.set_exception(RuntimeError(f"request {i} of the batch failed: {result.error}"))
            elif job.remaining == 0:
                job.future.set_result(BatchResult(job.results, job.tag))

    def _report_progress(self) -> None:
        for handle, (job, i) in self._inflight.items():
            if job.on_progress is None or job.future.done():
                continue
            partial = self.engine.partial(handle)  # None: it finished in this step (reported below)
            if partial is not None and len(partial.output_ids) > job.reported[i]:
                job.reported[i] = len(partial.output_ids)
                job.on_progress(i, partial)

    def _fail_inflight(self, error: BaseException) -> None:
        jobs = {id(job): job for job, _ in self._inflight.values()}
        self._inflight.clear()
        for job in jobs.values():
            if not job.future.done():
                job.future.set_exception(error)

    def _fail_waiting(self, pending: deque[_Job | None]) -> None:
        self._fail_inflight(RuntimeError("the engine loop stopped"))
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            if job is not None and not job.future.done():
                job.future.set_exception(RuntimeError("the engine loop stopped"))
