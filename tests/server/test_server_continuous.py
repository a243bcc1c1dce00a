"""Continuous batching across HTTP requests: a short request sent while a long one is generating
joins the running batch and is answered first, and both answers equal the local engine's run alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from support.server_proc import DTYPE, IDENTITY, ServerProc, local_engine, save_checkpoint

from tonpolicy.rollout.client import RolloutClient
from tonpolicy.rollout.engine.generation import GenRequest

LONG = ([5, 17, 300, 42, 7], {"max_new_tokens": 300, "sampling_seed": 1})  # ~2 s of decode on one core
SHORT = ([9, 8, 7], {"max_new_tokens": 4, "sampling_seed": 2})


def batches_run(client: RolloutClient) -> int:
    return client.server_info()["internal_states"][0]["batches_run"]


def test_short_request_overtakes_a_long_one_in_flight(tmp_path: Path) -> None:
    ckpt = save_checkpoint(tmp_path / "ckpt", seed=1)
    args = ["--model-path", str(ckpt), "--kernels", "ordered", "--dtype", DTYPE, *IDENTITY]
    srv = ServerProc(tmp_path, "cb", [*args, "--num-threads", "1", "--max-running-requests", "4"])
    client = srv.start_healthy()
    try:
        out: dict[str, dict[str, Any]] = {}
        finished: list[str] = []

        def send(name: str, prompt: list[int], params: dict[str, Any]) -> None:
            out[name] = client.generate([prompt], params)[0]
            finished.append(name)

        before = batches_run(client)
        long_thread = threading.Thread(target=send, args=("long", *LONG))
        long_thread.start()
        deadline = time.monotonic() + 30
        while batches_run(client) == before:  # the long request is in the engine
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.01)
        send("short", *SHORT)
        assert long_thread.is_alive(), "the long request finished before the short one was answered"
        long_thread.join(60)
        assert finished == ["short", "long"]
        assert batches_run(client) == before + 1, "the short request did not join the running batch"
        engine = local_engine(ckpt)
        for name, (prompt, params) in {"long": LONG, "short": SHORT}.items():
            req = GenRequest(prompt, params["max_new_tokens"], seed=params["sampling_seed"])
            exp = engine.generate([req])[0]
            assert out[name]["output_ids"] == exp.output_ids
            assert torch.equal(torch.tensor(out[name]["output_logprobs"], dtype=torch.float32), exp.output_logprobs)
    finally:
        assert srv.stop() == 0, srv.log()
