"""Per-token weight versions when an update arrives while a request is generating (what asynchronous
steps, issue 37 item 3, will rely on): the embedded server applies weights between requests, as SGLang's
/update_weights_from_disk does (its model_update_lock's writer waits for the generating requests, the
readers). The request in flight finishes under the old weights, bit for bit the local engine's run on
them, and says so (one span, every token `default`); a request sent after the update is all `step_1`."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from support.server_proc import DTYPE, IDENTITY, ServerProc, local_engine, save_checkpoint

from tonpolicy.rollout.engine.generation import GenRequest

LONG = ([5, 17, 300, 42, 7], {"max_new_tokens": 200, "sampling_seed": 1})  # ~1.5 s of decode on one core


def test_an_update_during_a_request_waits_and_each_token_names_its_version(tmp_path: Path) -> None:
    a, b = save_checkpoint(tmp_path / "a", seed=1), save_checkpoint(tmp_path / "b", seed=2)
    args = ["--model-path", str(a), "--kernels", "ordered", "--dtype", DTYPE, *IDENTITY, "--num-threads", "1"]
    srv = ServerProc(tmp_path, "versions", args)
    client = srv.start_healthy()
    try:
        out: dict[str, Any] = {}

        def long_request() -> None:
            out["long"] = client.generate([LONG[0]], LONG[1])[0]

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 30
        while client.server_info()["internal_states"][0]["batches_run"] == 0:  # not yet in the engine
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.01)
        assert thread.is_alive()
        client.update_weights_from_disk(str(b), weight_version="step_1")
        thread.join(60)
        after = client.generate([[9, 8, 7]], {"max_new_tokens": 4, "sampling_seed": 2})[0]
    finally:
        srv.stop()
    long = out["long"]
    # every token sampled by the old weights: the update waited for the request in flight
    exp = local_engine(a).generate([GenRequest(LONG[0], LONG[1]["max_new_tokens"], seed=LONG[1]["sampling_seed"])])[0]
    assert long["output_ids"] == exp.output_ids
    assert torch.equal(torch.tensor(long["output_logprobs"], dtype=torch.float32), exp.output_logprobs)
    assert long["weight_version"] == "default" and long["weight_versions"] == ["default"] * len(long["output_ids"])
    assert len(long["output_ids"]) == LONG[1]["max_new_tokens"]
    assert after["weight_versions"] == ["step_1"] * 4
