"""The trainer's side of disk-free weight sync (rollout.weight_sync=distributed): rank 0 makes the
weight-update group with the server's engine ranks once, then each step announces the HF-named
tensors over HTTP (`/update_weights_from_distributed`, inside SGLang's `/begin_weight_update` ...
`/end_weight_update` session) while it broadcasts them. Both calls block until
the other side takes part, so the HTTP call runs in a thread beside the broadcast."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from tonpolicy.launch.procs import free_port
from tonpolicy.rollout.weight_sync import DEFAULT_GROUP, destroy, dtype_name, init_update_group, send


def _beside(call: Callable[[], Any], work: Callable[[Callable[[], bool]], Any]) -> Any:
    """Run `call` (an HTTP request) in a thread while `work(failed)` runs here; `failed()` says whether
    the request has already failed (the other side will then never join `work`). Returns the answer."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["answer"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised on this thread
            box["error"] = e

    thread = threading.Thread(target=run, name="tonpolicy-weight-sync-http", daemon=True)
    thread.start()
    try:
        work(lambda: "error" in box)
    except BaseException:
        if "error" in box:  # the request's refusal is the cause: report it
            raise box["error"] from None
        raise
    finally:
        thread.join(timeout=5)
    if "error" in box:
        raise box["error"]
    return box["answer"]


class WeightPusher:
    def __init__(self, client: Any, engine_ranks: int, backend: str, timeout_s: float,
                 address: str = "127.0.0.1", group_name: str = DEFAULT_GROUP) -> None:  # fmt: skip
        self.client, self.group_name, self.group = client, group_name, None
        port, world = free_port(address), 1 + engine_ranks

        def join(failed: Callable[[], bool]) -> None:
            self.group = init_update_group(backend, address, port, world, 0, group_name, timeout_s)

        _beside(lambda: client.init_weights_update_group(address, port, 1, world, group_name, backend), join)

    def push(self, state_dict: dict[str, torch.Tensor], weight_version: str) -> None:
        names = list(state_dict)
        tensors = [state_dict[n] for n in names]
        self.client.begin_weight_update()  # SGLang's session around weight loads
        try:
            _beside(
                lambda: self.client.update_weights_from_distributed(
                    names, [dtype_name(t) for t in tensors], [list(t.shape) for t in tensors], self.group_name,
                    weight_version,
                ),
                lambda failed: send(self.group, tensors, abandon=failed),
            )  # fmt: skip
        finally:
            self.client.end_weight_update()

    def close(self) -> None:
        if self.group is not None:
            try:
                self.client.destroy_weights_update_group(self.group_name)
            except Exception:  # noqa: BLE001 - the server may be gone already; the group goes anyway
                pass
            destroy(self.group)
            self.group = None
