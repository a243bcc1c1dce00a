"""The engine loop feeds requests into the running engine between steps, and runs calls (weight
reloads, cache flushes) in arrival order only once no request is in flight."""

from __future__ import annotations

import torch
from support.kernel_utils import num_threads

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3
from tonpolicy.rollout.engine import Engine, GenRequest
from tonpolicy.rollout.engine.loop import EngineLoop


def test_calls_wait_for_in_flight_requests_and_keep_arrival_order() -> None:
    with num_threads(1):
        engine = Engine(Qwen3(ModelConfig(), get_kernels("ordered"), torch.bfloat16), max_running_requests=4)
        loop = EngineLoop(engine, batch_wait_s=0)
        loop.tag = "v1"
        loop.start()
        seen: list[tuple[bool, int]] = []

        def update(e: Engine) -> None:
            seen.append((e.has_work(), loop.requests_run))
            loop.tag = "v2"

        long = loop.generate([GenRequest([1, 2, 3], 40, seed=1), GenRequest([4], 0)])
        call = loop.call(update)
        after = loop.generate([GenRequest([5, 6], 3, seed=2)])
        bad = loop.generate([GenRequest([], 3)])
        done = after.result(60)
        loop.stop()
    assert call.result() is None and seen == [(False, 2)]  # ran after both earlier requests, idle
    assert long.result().tag == "v1" and done.tag == "v2"
    assert [len(r.output_ids) for r in long.result().results] == [40, 0]
    assert isinstance(bad.exception(), ValueError) and not loop.is_alive()
    alone = Engine(engine.model, max_running_requests=1).generate([GenRequest([5, 6], 3, seed=2)])[0]
    assert torch.equal(done.results[0].output_logprobs, alone.output_logprobs)


def test_one_failing_request_fails_only_its_own_job(monkeypatch) -> None:  # noqa: ANN001
    """A request whose sampling raises mid-batch ends its own job with the error; the requests of
    other jobs batched with it finish normally (they used to get the error too)."""
    import tonpolicy.rollout.engine.core as engine_module

    real = engine_module.sample_token

    def sample_token(logits, vocab, temperature, top_p, top_k, gen):  # noqa: ANN001, ANN202
        if gen.initial_seed() == 666:
            raise FloatingPointError("poisoned request")
        return real(logits, vocab, temperature, top_p, top_k, gen)

    monkeypatch.setattr(engine_module, "sample_token", sample_token)
    with num_threads(1):
        engine = Engine(Qwen3(ModelConfig(), get_kernels("ordered"), torch.bfloat16), max_running_requests=8)
        loop = EngineLoop(engine, batch_wait_s=0.05)
        loop.start()
        innocent = loop.generate([GenRequest([1, 2, 3], 6, seed=1), GenRequest([7, 8], 6, seed=2)])
        poisoned = loop.generate([GenRequest([4, 5], 6, seed=3), GenRequest([9], 6, seed=666)])
        bad_seed = loop.generate([GenRequest([4, 5], 6, seed=2**64)])
        later = loop.generate([GenRequest([6], 4, seed=4)])
        results = innocent.result(60).results
        assert later.result(60).results[0].finish_reason == "length"
        loop.stop()
    assert [len(r.output_ids) for r in results] == [6, 6] and all(r.finish_reason == "length" for r in results)
    error = poisoned.exception(60)
    assert isinstance(error, RuntimeError) and "FloatingPointError: poisoned request" in str(error)
    assert isinstance(bad_seed.exception(60), ValueError)


def test_run_steps_the_engine_in_the_calling_thread_until_stop_is_requested() -> None:
    """The server's way: the loop runs on the thread that owns torch's OpenMP team (its main thread);
    requests sent from other threads are answered there, then `request_stop` ends it."""
    import threading
    import time

    with num_threads(1):
        engine = Engine(Qwen3(ModelConfig(), get_kernels("ordered"), torch.bfloat16), max_running_requests=4)
        loop = EngineLoop(engine, batch_wait_s=0)
        steppers: set[str] = set()
        real_step = engine.step

        def step():  # noqa: ANN202
            steppers.add(threading.current_thread().name)
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        started: list[bool] = []

        answers = []

        def client() -> None:
            while not loop.is_alive():
                time.sleep(0.01)
            answers.append(loop.generate([GenRequest([1, 2], 3, seed=1)]).result(60))
            loop.request_stop()

        threading.Thread(target=client).start()
        loop.run(on_start=lambda: started.append(loop.is_alive()))
    assert started == [True] and not loop.is_alive()
    assert steppers == {threading.current_thread().name}
    assert len(answers[0].results[0].output_ids) == 3
    after = loop.generate([GenRequest([4], 1)])
    assert isinstance(after.exception(0), RuntimeError)  # the loop has stopped
