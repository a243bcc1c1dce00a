"""Disk-free weight sync (SGLang's /init_weights_update_group + /update_weights_from_distributed) with
the embedded server: this test process plays the trainer's rank 0. New weights broadcast over a gloo
group give exactly the answers a local engine gives with them; an update the server refuses is
reported, leaves the served weights alone, and does not leave the sender waiting."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.server_proc import DTYPE, IDENTITY, ServerProc, local_engine, save_checkpoint

from tonpolicy.config.model import ModelConfig
from tonpolicy.loop.weight_sync import WeightPusher
from tonpolicy.model.checkpoint import init_state_dict, load_hf
from tonpolicy.rollout.client import RolloutClient, RolloutError
from tonpolicy.rollout.engine.generation import GenRequest
from tonpolicy.rollout.weight_group import DEFAULT_GROUP, buckets, init_update_group, listen

PROMPTS = [[3, 11, 12], [5, 17, 18, 19, 4]]
PARAMS = [{"max_new_tokens": 5, "sampling_seed": s} for s in (1, 2)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ckpts")
    return {"a": save_checkpoint(d / "a", seed=1), "b": save_checkpoint(d / "b", seed=2)}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, ckpts: dict[str, Path]) -> Iterator[RolloutClient]:
    args = ["--model-path", str(ckpts["a"]), "--dtype", DTYPE, "--skip-tokenizer-init", *IDENTITY]
    srv = ServerProc(tmp_path_factory.mktemp("server"), "server", args)
    client = srv.start_healthy()
    yield client
    assert srv.stop() == 0, srv.log()


def expected(ckpt: Path) -> list[list[float]]:
    results = local_engine(ckpt).generate(
        [GenRequest(p, 5, seed=s["sampling_seed"]) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    )
    return [r.output_logprobs.tolist() for r in results]


# Per-tensor broadcasts; all tensors as one flat byte bucket (SGLang's "flattened_bucket"); and
# buckets small enough that one push takes several requests.
BUCKETS = {"per_tensor": 0, "one_bucket": 1 << 30, "small_buckets": 48 << 10}


@pytest.mark.parametrize("bucket_bytes", BUCKETS.values(), ids=BUCKETS.keys())
def test_weights_broadcast_over_a_group_are_served_bit_for_bit(
    client: RolloutClient, ckpts: dict[str, Path], bucket_bytes: int
) -> None:
    _, old = load_hf(ckpts["a"])
    client.update_weights_from_disk(str(ckpts["a"]))  # the module's server starts every case on `a`
    before = [o["output_logprobs"] for o in client.generate(PROMPTS, PARAMS)]
    assert before == expected(ckpts["a"])
    pusher = WeightPusher(client, engine_ranks=1, backend="gloo", timeout_s=60, bucket_bytes=bucket_bytes)
    try:
        _, new = load_hf(ckpts["b"])
        pusher.push(new, weight_version="step_1")
        after = client.generate(PROMPTS, PARAMS)
        assert all(o["weight_version"] == "step_1" for o in after)
        assert [o["output_logprobs"] for o in after] == expected(ckpts["b"]) != before

        # A refused update (a tensor of the wrong shape): a clear error, no hang; within one request
        # nothing is loaded (with several buckets, those before the refused one are, as in SGLang).
        bad = dict(new)
        bad["model.norm.weight"] = torch.zeros(7)
        with pytest.raises(RolloutError, match="wrong shape"):
            pusher.push(bad, weight_version="step_2")
        if bucket_bytes != BUCKETS["small_buckets"]:
            assert [o["output_logprobs"] for o in client.generate(PROMPTS, PARAMS)] == expected(ckpts["b"])
        if pusher.broken:
            # The refusal came while a bucket's broadcast still waited for the receiver (gloo completes a
            # send once the socket has taken it all: a matter of timing and buffer sizes): that group is
            # unusable by design, said clearly, and a new one carries on.
            assert "refused" in pusher.broken
            with pytest.raises(RuntimeError, match="unusable"):
                pusher.push(new, weight_version="step_2")
            pusher.close()
            pusher = WeightPusher(client, engine_ranks=1, backend="gloo", timeout_s=60, bucket_bytes=bucket_bytes)

        # A push that leaves a weight out: refused (per request, or at the end of a bucketed session).
        partial = {k: v for k, v in old.items() if k != "model.norm.weight"}
        with pytest.raises(RolloutError, match="missing|unsent"):
            pusher.push(partial, weight_version="step_3")

        pusher.push(old, weight_version="step_4")  # the group (or its successor) works after a refusal
        assert [o["output_logprobs"] for o in client.generate(PROMPTS, PARAMS)] == before
    finally:
        pusher.close()


def test_sglangs_session_rules(client: RolloutClient) -> None:
    with pytest.raises(RolloutError, match="no weight update group"):
        client.update_weights_from_distributed(["x"], ["float32"], [[1]], "weight_update_group")
    with pytest.raises(RolloutError, match="no weight-update session is open"):
        client.end_weight_update()
    client.begin_weight_update()
    with pytest.raises(RolloutError, match="already open"):
        client.begin_weight_update()
    client.end_weight_update()
    with pytest.raises(RolloutError, match="rank_offset=0 must be in"):
        client.init_weights_update_group("127.0.0.1", 1, 0, 2, "g", "gloo")


def test_a_refused_announcement_does_not_leave_the_sender_waiting(client: RolloutClient) -> None:
    """The server refuses the announcement before it receives anything (here: another group's name),
    so it never joins the broadcast: the sender must give it up and report the server's reason."""

    class WrongGroup:
        def __getattr__(self, name: str):  # noqa: ANN204 - delegate everything else
            return getattr(client, name)

        def update_weights_from_distributed(self, names, dtypes, shapes, group_name, *rest):  # noqa: ANN001, ANN002, ANN201
            return client.update_weights_from_distributed(names, dtypes, shapes, "another_group", *rest)

    pusher = WeightPusher(WrongGroup(), engine_ranks=1, backend="gloo", timeout_s=60)
    try:
        sd = init_state_dict(ModelConfig(), torch.bfloat16, 3)
        with pytest.raises(RolloutError, match="no weight update group"):
            pusher.push(sd, weight_version="x")
        # The abandoned broadcast would pair with the next push's tensors: the pusher says so instead.
        with pytest.raises(RuntimeError, match="unusable"):
            pusher.push(sd, weight_version="y")
    finally:
        pusher.close()


def test_a_server_that_will_not_join_does_not_leave_the_trainer_waiting(client: RolloutClient) -> None:
    class Refuses:
        def init_weights_update_group(self, *args: object) -> None:
            raise RolloutError("/init_weights_update_group failed (HTTP 400): no")

    t0 = time.monotonic()
    with pytest.raises(RolloutError, match="no"):
        WeightPusher(Refuses(), engine_ranks=1, backend="gloo", timeout_s=8)
    assert time.monotonic() - t0 < 4  # not the 8 s the store would wait for the server
    time.sleep(9)  # let the store's own timeout end its waiting thread before the process goes on


def test_buckets_stay_within_their_size() -> None:
    sizes = [torch.zeros(n) for n in (10, 10, 30, 5, 5)]  # fp32: 40, 40, 120, 20, 20 bytes
    assert buckets(sizes, 80) == [[0, 1], [2], [3, 4]]  # a tensor larger than a bucket goes alone
    assert buckets(sizes, 1 << 20) == [[0, 1, 2, 3, 4]]


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.append(local.rsplit(":", 1)[0])
    return found


def test_only_ranks_told_the_group_name_can_join() -> None:
    """The trainer's rendezvous store listens on the trainer's address alone (not every interface),
    and a process that reaches its port but was not told the run's secret group name (here: SGLang's
    default one) never meets rank 0: the group does not form with it."""
    listener = listen("127.0.0.1")
    port = listener.getsockname()[1]
    intruder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tonpolicy.rollout.weight_group import init_update_group; "
         f"init_update_group('gloo', '127.0.0.1', {port}, 2, 1, {DEFAULT_GROUP!r}, timeout_s=5)"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
            init_update_group("gloo", "127.0.0.1", port, 2, 0, f"{DEFAULT_GROUP}_secret", 5, listener=listener)
        assert _listening(port) in ([], ["0100007F"])  # only loopback, if the store still listens
    finally:
        _, err = intruder.communicate(timeout=60)
    assert intruder.returncode != 0, "the intruder joined the group"
    assert "timeout" in err.lower() or "timed out" in err.lower(), err[-2000:]


def test_the_store_listens_on_the_given_address_only() -> None:
    import threading

    listener = listen("127.0.0.1")
    port = listener.getsockname()[1]
    joined: dict[str, object] = {}
    rank0 = threading.Thread(
        target=lambda: joined.setdefault("pg", init_update_group("gloo", "127.0.0.1", port, 2, 0, "g", 10, listener)),
        daemon=True,
    )
    rank0.start()
    deadline = time.monotonic() + 10
    while not _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(port) == ["0100007F"]  # 127.0.0.1 only: no 0.0.0.0 or [::] socket for the store
    peer = subprocess.run(
        [sys.executable, "-c", "from tonpolicy.rollout.weight_group import init_update_group, destroy; "
         f"destroy(init_update_group('gloo', '127.0.0.1', {port}, 2, 1, 'g', 10))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    rank0.join(30)
    assert peer.returncode == 0, peer.stderr[-2000:]
    assert "pg" in joined  # the rank told the name joins
