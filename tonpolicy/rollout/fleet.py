"""A fleet of rollout servers behind sglang-router, seen by the trainer as one client.

Generation goes through the router only: one /generate per sample, sent together, so the router's
policy spreads the step's samples over the replicas (a batched /generate would go to one replica
whole). Everything that changes or checks a server goes to every replica, directly: weight updates
(a replica must have loaded the new weights before the next step's requests, whichever replica the
router picks), the contract handshake (`replicas`), the weight-update group (one group; replica i's
engine ranks at rank offset 1 + i * ranks per replica).

Same methods as `RolloutClient`, so the step loop and `WeightSync` drive one server or a fleet alike.

A member that dies is replaced by the launcher (tonpolicy.launch.rollout_fleet.replace_member: same url, the weight
version the others serve, one line in RESTARTS_FILE). Meanwhile, with `recover_s` > 0, a sample whose
request failed is re-sent once the fleet is whole again (every member healthy, every replica at one weight
version): the same rid and seeds, so the same bits; a load from disk or a cache flush that failed on a
replica is sent to it again once it answers. Both are counted (`take_events`).

Under rollout.weight_sync=distributed nothing but the initial weights is on disk: a replacement starts
from them under UNSYNCED_VERSION, and `rejoin` (the weight sync's) forms a new weight-update group with
every replica and sends them the weights last pushed. A sample the replacement answered before that is
re-sent like a failed one: the same rid and seeds, so the same bits.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tonpolicy.rollout.client import RETRIES, RolloutClient, RolloutError

# Samples in flight through the router at once (each a blocking HTTP request on its own thread).
MAX_CONCURRENT_SAMPLES = 64
# In the run directory: one JSON line per fleet member the launcher replaced.
RESTARTS_FILE = "rollout_restarts.jsonl"
# The weight version a replacement replica reports until the trainer has sent it the fleet's weights
# (rollout.weight_sync=distributed); not a policy version, so no token of it can pass the version check.
UNSYNCED_VERSION = "unsynced"
# Re-sends of one sample once the fleet is whole again (a member may die again meanwhile).
RESENDS = 3


class FleetClient:
    def __init__(
        self,
        router_url: str,
        replica_urls: Sequence[str],
        timeout_s: float = 600.0,
        retries: int = RETRIES,
        recover_s: float = 0.0,
        run_dir: Path | None = None,
    ) -> None:
        """`recover_s`: how long a failed sample or load waits for the fleet to be whole again before it
        is re-sent (0: not re-sent); `run_dir`: where the launcher logs its replacements."""
        if not replica_urls:
            raise ValueError("a fleet needs at least one replica url")
        self.router = RolloutClient(router_url, timeout_s=timeout_s, retries=retries)
        self.replicas = [RolloutClient(u, timeout_s=timeout_s, retries=retries) for u in replica_urls]
        self.base_url = self.router.base_url
        self.recover_s = recover_s
        self.restarts_path = run_dir / RESTARTS_FILE if run_dir is not None else None
        self._restarts_seen = 0
        self._resent = 0
        self._lock = threading.Lock()
        self._recovering = threading.Lock()  # one sample thread polls the fleet; the others wait for it
        # Set by the weight sync (rollout.weight_sync=distributed): a new weight-update group with every
        # replica, and the weights last pushed sent to them, for a replacement that serves none yet.
        self.rejoin: Callable[[], None] | None = None

    def _each(self, call: Callable[[RolloutClient], Any], resend: bool = False) -> list[Any]:
        """`call` on every replica at once (a weight-group call blocks until all ranks join); the
        first failure is raised, naming the replica. `resend`: the call is safe to repeat, and a replica
        it failed on gets it again once that replica (or its replacement) answers."""

        def once_more(r: RolloutClient) -> Any:
            try:
                return call(r)
            except RolloutError:
                if not self.recover_s or not self._wait(lambda: r.health(2.0)):
                    raise
            self._count_resent()
            return call(r)

        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="tonpolicy-fleet") as pool:
            futures = [pool.submit(once_more if resend else call, r) for r in self.replicas]
            answers, errors = [], []
            for r, f in zip(self.replicas, futures, strict=True):
                try:
                    answers.append(f.result())
                except Exception as e:  # noqa: BLE001 - re-raised below with the replica's url
                    errors.append(f"replica {r.base_url}: {e}")
        if errors:
            raise RolloutError("; ".join(errors))
        return answers

    def take_retries(self) -> int:
        """Requests re-sent (to the router or any replica) since the last call."""
        return sum(c.take_retries() for c in (self.router, *self.replicas))

    def take_events(self) -> dict[str, int]:
        """Since the last call: members the launcher replaced (`rollout_restarts`) and requests re-sent
        once the fleet was whole again (`requests_resent`)."""
        lines = 0
        if self.restarts_path is not None and self.restarts_path.exists():
            lines = sum(1 for line in self.restarts_path.read_text().splitlines() if line.strip())
        with self._lock:
            restarts, self._restarts_seen = lines - self._restarts_seen, lines
            resent, self._resent = self._resent, 0
        return {"rollout_restarts": restarts, "requests_resent": resent}

    def replica_restarts(self) -> int:
        """Replicas (not the router) the launcher has replaced this run, from its log of replacements."""
        if self.restarts_path is None or not self.restarts_path.exists():
            return 0
        lines = [line for line in self.restarts_path.read_text().splitlines() if line.strip()]
        return sum(1 for line in lines if json.loads(line).get("member") != "rollout-router")

    def replicas_healthy(self) -> bool:
        """Every replica answers /health, waiting up to `recover_s` (a replacement may still be loading)."""
        return self._wait(lambda: all(r.health(2.0) for r in self.replicas))

    def _count_resent(self) -> None:
        with self._lock:
            self._resent += 1

    def _wait(self, ready: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + self.recover_s
        while time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(0.2)
        return False

    def _versions(self) -> set[Any] | None:
        """The weight versions the replicas serve, once every member answers /health (None before)."""
        if not all(c.health(2.0) for c in (self.router, *self.replicas)):
            return None
        try:
            return {r.model_info().get("weight_version") for r in self.replicas}
        except (RolloutError, ValueError):
            return None

    def _restored(self) -> bool:
        """`whole`, once a replacement that serves no weights yet has been sent them (`rejoin`)."""
        if self.rejoin is not None and UNSYNCED_VERSION in (self._versions() or ()):
            self.rejoin()  # a failure is the step's cause: it propagates
        return self.whole()

    def whole(self) -> bool:
        """Every member answers /health and every replica serves one weight version."""
        versions = self._versions()
        return versions is not None and len(versions) == 1

    # --- generation, through the router ----------------------------------------------------

    def health(self, timeout_s: float = 10.0) -> bool:
        return self.router.health(timeout_s)

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.2) -> None:
        for client in (*self.replicas, self.router):
            client.wait_healthy(timeout_s, poll_s)

    def generate(
        self,
        input_ids_batch: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
        return_routed_experts: bool = False,
    ) -> list[dict[str, Any]]:
        n = len(input_ids_batch)
        params = [sampling_params] * n if isinstance(sampling_params, dict) else list(sampling_params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")

        def send(i: int) -> tuple[dict[str, Any] | None, RolloutError | None]:
            try:
                out = self.router.generate([input_ids_batch[i]], params[i], return_routed_experts)[0]
            except RolloutError as e:
                return None, e
            if out.get("weight_version") == UNSYNCED_VERSION:  # a replacement not yet sent the weights
                return None, RolloutError("a replacement replica answered before it had the fleet's weights")
            return out, None

        def one(i: int) -> dict[str, Any]:
            out, cause = send(i)
            for _ in range(RESENDS if self.recover_s else 0):
                if out is not None:
                    return out
                with self._recovering:
                    if not self._wait(self._restored):
                        raise RolloutError(f"{cause}; the fleet was not whole again within {self.recover_s:.0f}s")
                self._count_resent()  # the same rid and seeds: the same sample, wherever it runs now
                out, cause = send(i)
            if out is None:
                assert cause is not None
                raise cause
            return out

        if n == 0:
            return []
        with ThreadPoolExecutor(min(n, MAX_CONCURRENT_SAMPLES), thread_name_prefix="tonpolicy-sample") as pool:
            return list(pool.map(one, range(n)))

    def server_info(self) -> dict[str, Any]:
        return self.replicas[0].server_info()

    def model_info(self) -> dict[str, Any]:
        return self.replicas[0].model_info()

    def contract(self) -> dict[str, Any] | None:
        """Replica 0's; the handshake checks each of `replicas` on its own."""
        return self.replicas[0].contract()

    def requests_served(self) -> list[int | None]:
        """Per replica, the requests it has run (the embedded server's counter; None where not reported)."""

        def count(r: RolloutClient) -> int | None:
            states = r.server_info().get("internal_states") or [{}]
            value = states[0].get("requests_run")
            return int(value) if value is not None else None

        return self._each(count)

    # --- weights, on every replica ---------------------------------------------------------

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        return self._each(lambda r: r.update_weights_from_disk(path, weight_version), resend=True)[0]

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        # `world_size` counts every replica's engine ranks (weight_sync_for); each replica takes its share.
        per, left = divmod(world_size - rank_offset, len(self.replicas))
        if left:
            raise RolloutError(f"{world_size - rank_offset} engine ranks do not split over {len(self.replicas)}")
        index = {id(r): i for i, r in enumerate(self.replicas)}

        def join(r: RolloutClient) -> dict[str, Any]:
            offset = rank_offset + index[id(r)] * per
            return r.init_weights_update_group(master_address, master_port, offset, world_size, group_name, backend)

        return self._each(join)[0]

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        return self._each(
            lambda r: r.update_weights_from_distributed(names, dtypes, shapes, group_name, weight_version, load_format)
        )[0]

    def begin_weight_update(self) -> dict[str, Any]:
        return self._each(lambda r: r.begin_weight_update())[0]

    def end_weight_update(self) -> dict[str, Any]:
        return self._each(lambda r: r.end_weight_update())[0]

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self._each(lambda r: r.destroy_weights_update_group(group_name))[0]

    def flush_cache(self) -> None:
        self._each(lambda r: r.flush_cache(), resend=True)


def rollout_client(
    server_url: str,
    replica_urls: Sequence[str] = (),
    retries: int = RETRIES,
    recover_s: float = 0.0,
    run_dir: Path | None = None,
) -> RolloutClient | FleetClient:
    """The trainer's client: one server, or a fleet (`server_url` is then the router's); `retries`:
    rollout.client_retries; `recover_s`, `run_dir`: a fleet's (FleetClient)."""
    if replica_urls:
        return FleetClient(server_url, replica_urls, retries=retries, recover_s=recover_s, run_dir=run_dir)
    return RolloutClient(server_url, retries=retries)


def fleet_events(client: Any) -> dict[str, int]:
    """A step record's fleet fields (none for one server)."""
    return client.take_events() if isinstance(client, FleetClient) else {}
