"""Weight sync: after a step's update the rollout server loads the new weights, through one interface
(`WeightSync`: `export` on every trainer rank, a collective; `push` on rank 0) with two ways:

- `DiskWeightSync` (rollout.weight_sync=disk): an HF checkpoint per step, then `/update_weights_from_disk`
  (on every replica of a fleet, rollout.replicas > 1: `tonpolicy.rollout.fleet`).
- `GroupWeightSync` (rollout.weight_sync=distributed, disk-free): rank 0 makes the weight-update group
  with the server's engine ranks once (`WeightPusher`), then each step announces the HF-named tensors
  over HTTP (`/update_weights_from_distributed`, inside SGLang's `/begin_weight_update` ...
  `/end_weight_update` session) while it broadcasts them. Both calls block until the other side takes
  part, so the HTTP call runs in a thread beside the broadcast. A fleet's replicas all join the one
  group (each at its own rank offset) and receive the same broadcast. A replica the launcher replaced
  cannot join a formed group: rank 0 forms a new one with every replica before its next push, or at
  once when the replacement is needed for a step's samples (it then sends the weights it last pushed,
  kept for that; tonpolicy.rollout.fleet).

Both ways carry the master weights, under contract.quant=fp8_block too: each engine quantizes them with the
one function (tonpolicy.kernels.fp8_block, per canonical K-shard of a row-parallel linear), so the rollout
runs the trainer's FP8 weights bit for bit; an FP8 file could not hold per-shard blocks (docs/FP8.md).

Each push names a weight version (`step_<k>`, policy version k; the initial weights are "default",
version 0); the servers report the version that sampled each token, and `check_versions` holds a
synchronous step to the version last pushed (an asynchronous one to the last max_staleness + 1).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tonpolicy.config.rollout_backends import rollout_backend
from tonpolicy.config.schema import Config
from tonpolicy.rollout.fleet import FleetClient
from tonpolicy.rollout.weight_group import (
    DEFAULT_GROUP,
    FLATTENED_BUCKET,
    buckets,
    destroy,
    dtype_name,
    init_update_group,
    listen,
    send,
)


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
        thread.join(timeout=5)  # a refusal is usually already in: report it as the cause
        if "error" in box:
            raise box["error"] from None
        raise
    thread.join()  # the server answers once it has loaded what it received (the client has its timeout)
    if "error" in box:
        raise box["error"]
    return box["answer"]


class WeightPusher:
    """Rank 0's end of the weight-update group: `push` sends one state dict to the server's engine ranks."""

    def __init__(
        self,
        client: Any,
        engine_ranks: int,
        backend: str,
        timeout_s: float,
        address: str = "127.0.0.1",
        group_name: str | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        # The store listens on `address` alone, and only the ranks told this run's secret group name
        # (over the server's authenticated HTTP) can find each other in it: nobody else joins the group.
        group_name = group_name or f"{DEFAULT_GROUP}_{secrets.token_hex(16)}"
        self.client, self.group_name, self.group = client, group_name, None
        # > 0: tensors go as flat byte buckets of at most this size (one broadcast each, SGLang's
        # "flattened_bucket"); 0: one broadcast per tensor.
        self.bucket_bytes = bucket_bytes
        self.device = "cuda" if backend == "nccl" else "cpu"  # NCCL moves CUDA tensors only
        self.broken: str | None = None  # why the group can no longer be used
        listener = listen(address)
        port, world = listener.getsockname()[1], 1 + engine_ranks

        def join(failed: Callable[[], bool]) -> None:
            # In a thread: a server that refuses to join must not leave the store waiting timeout_s.
            made: dict[str, Any] = {}

            def make() -> None:
                try:
                    made["group"] = init_update_group(
                        backend, address, port, world, 0, group_name, timeout_s, listener=listener
                    )
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    made["error"] = e

            maker = threading.Thread(target=make, name="tonpolicy-weight-group", daemon=True)
            maker.start()
            while maker.is_alive():
                if failed():
                    raise RuntimeError("the server did not join the weight-update group")
                maker.join(0.05)
            if "error" in made:
                raise made["error"]
            self.group = made["group"]

        _beside(lambda: client.init_weights_update_group(address, port, 1, world, group_name, backend), join)

    def push(self, state_dict: dict[str, torch.Tensor], weight_version: str) -> None:
        if self.broken:
            raise RuntimeError(f"the weight-update group is unusable: {self.broken}; close this pusher")
        # Widest dtype first, so every tensor of a flat bucket starts aligned to its dtype.
        names = sorted(state_dict, key=lambda n: -state_dict[n].element_size())
        tensors = [state_dict[n].to(self.device) for n in names]
        flattened = self.bucket_bytes > 0
        self.client.begin_weight_update()  # SGLang's session around weight loads
        try:
            groups = buckets(tensors, self.bucket_bytes) if flattened else [list(range(len(tensors)))]
            for group in groups:
                self._push_bucket([names[i] for i in group], [tensors[i] for i in group], weight_version, flattened)
        except BaseException:
            with contextlib.suppress(Exception):  # close the session; the first error is the one to report
                self.client.end_weight_update()
            raise
        self.client.end_weight_update()  # refuses a session whose buckets left weights unsent

    def _push_bucket(self, names: list[str], tensors: list[torch.Tensor], version: str, flattened: bool) -> None:
        def broadcast(failed: Callable[[], bool]) -> None:
            try:
                send(self.group, tensors, abandon=failed, flattened=flattened)
            except RuntimeError as e:
                # A broadcast left pending would pair with the next push's tensors: no more pushes.
                self.broken = str(e)
                raise

        _beside(
            lambda: self.client.update_weights_from_distributed(
                names, [dtype_name(t) for t in tensors], [list(t.shape) for t in tensors], self.group_name,
                version, FLATTENED_BUCKET if flattened else None,
            ),
            broadcast,
        )  # fmt: skip

    def close(self) -> None:
        if self.group is not None:
            try:
                self.client.destroy_weights_update_group(self.group_name)
            except Exception:  # noqa: BLE001 - the server may be gone already; the group goes anyway
                pass
            destroy(self.group)
            self.group = None


class PolicyVersionError(RuntimeError):
    """A step's batch holds tokens sampled by weights other than the ones the loop expects."""


# The version a server reports before any update (SGLang's ServerArgs.weight_version default, and the
# embedded server's): policy version 0.
INITIAL_WEIGHT_VERSION = "default"
INITIAL_POLICY_VERSION = 0


def policy_version(weight_version: str | None) -> int | None:
    """A weight version's number: 0 for the initial weights, k for `step_k` (the update after step
    k - 1); None for a name tonpolicy did not give."""
    if weight_version == INITIAL_WEIGHT_VERSION:
        return INITIAL_POLICY_VERSION
    if weight_version and weight_version.startswith("step_") and weight_version[5:].isdigit():
        return int(weight_version[5:])
    return None


def sampled_versions(versions: list[list[str | None]], masks: list[Any] | None = None) -> list[str | None]:
    """The weight versions of the sampled tokens: all of a sample's, or (a multi-turn batch, `masks` its
    response masks) the model's only: the environment's replies were not sampled."""
    if masks is None:
        return [v for sample in versions for v in sample]
    return [v for sample, mask in zip(versions, masks, strict=True) for v, m in zip(sample, mask, strict=True) if m]


class WeightSync:
    """`export` runs on every rank after a passed gate (it gathers the weights), before the step record;
    `push` runs on rank 0 after it, and the server then serves the new weights; `close` at the end.
    `version`: rank 0's, the weight version every server of the fleet serves since the last push."""

    version: str = INITIAL_WEIGHT_VERSION

    def check_versions(
        self, versions: list[list[str | None]] | None, max_staleness: int = 0, masks: list[Any] | None = None
    ) -> None:
        """Every token of the step was sampled by the weights last pushed (the trainer's current ones) or
        by one of the `max_staleness` versions before them. Synchronous steps (0): each replica's update
        is acknowledged before the next step's requests, so every token is of the last push. `masks`
        (a multi-turn batch's response masks): only the model's tokens were sampled. Raises
        PolicyVersionError."""
        if versions is None:  # a batch that does not carry them
            return
        current = policy_version(self.version)
        assert current is not None, self.version

        def allowed(v: str | None) -> bool:
            n = policy_version(v)
            return n is not None and current - max_staleness <= n <= current

        wrong = Counter(v for v in sampled_versions(versions, masks) if not allowed(v))
        if wrong:
            expected = (
                f"every token from {self.version!r} (policy version {current})"
                if max_staleness == 0
                else f"policy versions {max(current - max_staleness, 0)}..{current} (experiment.max_staleness="
                f"{max_staleness})"
            )
            raise PolicyVersionError(
                f"tokens sampled by weight versions {dict(wrong)}, expected {expected}: "
                + ("a rollout server missed a weight update" if max_staleness == 0 else "a sample is too stale")
            )

    def export(self, worker: Any, step: int) -> None:
        raise NotImplementedError

    def push(self, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def weight_version(step: int) -> str:
    """The version the server reports after step `step`'s update (the weights of step_<step + 1>)."""
    return f"step_{step + 1}"


class DiskWeightSync(WeightSync):
    """An HF checkpoint per step under `run_dir/checkpoints/`, which the server loads (`client`: rank 0's)."""

    def __init__(self, client: Any, run_dir: Path) -> None:
        self.client, self.run_dir = client, run_dir

    def _checkpoint(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / weight_version(step)

    def export(self, worker: Any, step: int) -> None:
        worker.save_hf(self._checkpoint(step))

    def push(self, step: int) -> None:
        self.client.update_weights_from_disk(str(self._checkpoint(step)), weight_version=weight_version(step))
        self.version = weight_version(step)  # every replica answered success (a fleet's client asks each)


class GroupWeightSync(WeightSync):
    """The weights gathered on rank 0 and broadcast over the weight-update group (`pusher`: rank 0's,
    None on the other ranks, which only take part in the gather).

    A fleet whose replicas the launcher may replace (`fleet`, with `remake`: a new pusher with every
    replica): a replacement cannot join the formed group, so a new one is formed before the next push,
    or at once (`rejoin`) when the replacement is needed for a step's samples; the weights last pushed
    stay on rank 0 (host memory) to be sent to it."""

    def __init__(
        self, pusher: WeightPusher | None, fleet: Any = None, remake: Callable[[], WeightPusher] | None = None
    ) -> None:
        self.pusher = pusher
        self.weights: dict[str, torch.Tensor] | None = None
        self.fleet, self.remake = fleet, remake
        self.last: dict[str, torch.Tensor] | None = None  # the weights of `version`, kept for a replacement
        self.formed_at = fleet.replica_restarts() if fleet is not None else 0  # replacements the group has
        self.lock = threading.Lock()  # a rejoin from a sample thread and a push never overlap

    def export(self, worker: Any, step: int) -> None:
        self.weights = worker.hf_state_dict()  # on rank 0; every rank takes part in the gather

    def push(self, step: int) -> None:
        assert self.pusher is not None and self.weights is not None, "push runs on rank 0 after export"
        with self.lock:
            self._reform()
            assert self.pusher is not None
            try:
                self.pusher.push(self.weights, weight_version=weight_version(step))
            except Exception:
                if not self._replaced_meanwhile():
                    raise
                # A replica died during the push: the group is formed again with its replacement and
                # the same weights sent again (the survivors load the same bits a second time).
                self._reform()
                self.pusher.push(self.weights, weight_version=weight_version(step))
            if self.remake is not None:
                self.last = self.weights
            self.weights = None
            self.version = weight_version(step)

    def _reform(self) -> bool:
        """A new group with every replica where the launcher replaced one since this group was formed."""
        if self.fleet is None or self.remake is None or self.fleet.replica_restarts() == self.formed_at:
            return False
        if not self.fleet.replicas_healthy():
            raise RuntimeError("a replaced replica did not answer /health: no weight-update group can be formed")
        self.formed_at = self.fleet.replica_restarts()
        if self.pusher is not None:
            self.pusher.close()  # the survivors leave the old group; the replacement never knew it
        self.pusher = self.remake()
        return True

    def _replaced_meanwhile(self) -> bool:
        """After a failed push: whether the launcher replaced a replica since the group was formed,
        waiting while one does not answer (the launcher may not have ended it yet) up to the fleet's
        recovery time. A push that failed with every replica answering was not a replica's death."""
        if self.fleet is None or self.remake is None:
            return False
        deadline = time.monotonic() + self.fleet.recover_s
        while time.monotonic() < deadline:
            if self.fleet.replica_restarts() != self.formed_at:
                return True
            if all(r.health(2.0) for r in self.fleet.replicas):
                return False
            time.sleep(0.2)
        return False

    def rejoin(self) -> None:
        """A replacement replica serves no weights yet (it started from the initial ones): a new group
        with every replica, and the weights of the current version sent to all of them (the others
        load the same bits again)."""
        with self.lock:
            self._reform()
            if self.last is None:
                raise RuntimeError(f"no weights of version {self.version!r} are kept to send to a replaced replica")
            assert self.pusher is not None
            self.pusher.push(self.last, weight_version=self.version)

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()


def weight_sync_for(cfg: Config, client: Any, run_dir: Path, device: str) -> WeightSync:
    """The configured weight sync; `client` is rank 0's rollout client, None on the other ranks."""
    if cfg.rollout.weight_sync == "disk":
        return DiskWeightSync(client, run_dir)
    if client is None:
        return GroupWeightSync(None)
    # Every replica's engine ranks join the one group; the fleet's client gives each its rank offset.
    engine_ranks = rollout_backend(cfg.rollout.backend).engine_ranks(cfg) * cfg.rollout.replicas
    backend = cfg.rollout.weight_sync_backend or ("nccl" if device == "cuda" else "gloo")
    # The group meets at rank 0's node (node 0): engine ranks on other nodes must reach it there.

    def make() -> WeightPusher:
        return WeightPusher(
            client,
            engine_ranks,
            backend,
            cfg.trainer.timeout_s,
            address=cfg.trainer.master_addr,
            bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20,
        )

    if not isinstance(client, FleetClient) or cfg.rollout.max_restarts == 0:
        return GroupWeightSync(make())  # one server, or a fleet that replaces no replica
    sync = GroupWeightSync(make(), fleet=client, remake=make)
    client.rejoin = sync.rejoin  # the fleet's client calls it for a replacement that has no weights yet
    return sync
