"""The rollout client's retries, against a stand-in server on this machine: a transient 5xx or a refused
connection is re-sent (the same bytes: the same rid and seeds) and counted, a request that keeps failing
is a RolloutError naming the cause after the bound, and what may not be sent twice is not."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tonpolicy.ports import free_port
from tonpolicy.rollout.client import RolloutClient, RolloutError

SAMPLE = {"output_ids": [4, 5], "meta_info": {"output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]]}}


class StandIn(ThreadingHTTPServer):
    """Answers each request with the next of `statuses` (the last one from then on; 0: drops the connection
    unanswered, a reset); keeps the bodies."""

    daemon_threads = True

    def __init__(self, statuses: list[int]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.statuses, self.bodies, self.paths = statuses, [], []


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def _answer(self) -> None:
        s = self.server
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        s.bodies.append(json.loads(raw) if raw else None)
        s.paths.append(self.path)
        status = s.statuses[min(len(s.bodies), len(s.statuses)) - 1]
        if status == 0:
            self.close_connection = True
            return
        if status == 200 and self.path == "/generate":
            payload = json.dumps([SAMPLE] * len(s.bodies[-1]["input_ids"])).encode()
        elif status == 200:
            payload = json.dumps({"success": True, "message": "ok"}).encode()
        elif status == 409:  # released SGLang's refusal of a rid still in flight (a 400)
            status = 400
            payload = json.dumps({"error": {"message": f"Duplicate request ID detected: {s.bodies[-1]['rid']}_0"}})
            payload = payload.encode()
        else:
            payload = json.dumps({"error": {"message": f"stand-in says {status}"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator:
    servers: list[StandIn] = []

    def start(statuses: list[int]) -> tuple[StandIn, RolloutClient]:
        srv = StandIn(statuses)
        servers.append(srv)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return srv, RolloutClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=10, backoff_s=0.01)

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _generate(client: RolloutClient) -> list[dict]:
    return client.generate([[1, 2, 3], [1, 2, 3]], [{"sampling_seed": 7}, {"sampling_seed": 8}])


def test_two_503s_then_an_answer_is_two_counted_retries_of_the_same_request(serve) -> None:
    srv, client = serve([503, 503, 200])
    outs = _generate(client)
    assert [o["output_ids"] for o in outs] == [[4, 5], [4, 5]]
    assert client.take_retries() == 2 and client.take_retries() == 0  # counted once, then taken
    assert len(srv.bodies) == 3 and srv.bodies[0] == srv.bodies[1] == srv.bodies[2]  # same rid, same seeds
    rid = srv.bodies[0]["rid"]
    assert isinstance(rid, str) and rid  # a batch's prefix: sglang-router takes no list
    _generate(client)
    assert srv.bodies[-1]["rid"] == rid  # the same request later: the same rid
    client.generate([[1, 2, 3]], {"sampling_seed": 9})
    assert srv.bodies[-1]["rid"] != rid  # another request: another rid


def test_a_server_that_keeps_answering_503_fails_after_the_bound_naming_the_status(serve) -> None:
    srv, client = serve([503])
    client.retries = 3
    with pytest.raises(
        RolloutError, match=r"HTTP 503 \(after 3 retries, bound: rollout.client_retries\).*stand-in says 503"
    ):
        _generate(client)
    assert len(srv.bodies) == 4 and client.take_retries() == 3


def test_a_refused_connection_is_retried_then_named(serve) -> None:
    client = RolloutClient(f"http://127.0.0.1:{free_port()}", timeout_s=5, retries=2, backoff_s=0.01)
    with pytest.raises(RolloutError, match=r"(?i)refused.*\(after 2 retries, bound: rollout.client_retries\)"):
        client.server_info()
    assert client.take_retries() == 2


def test_a_reset_connection_is_retried(serve) -> None:
    srv, client = serve([0, 200])
    assert len(_generate(client)) == 2 and client.take_retries() == 1 and srv.bodies[0] == srv.bodies[1]


def test_a_400_is_not_retried(serve) -> None:
    srv, client = serve([400, 200])
    with pytest.raises(RolloutError, match="HTTP 400: .*stand-in says 400"):
        _generate(client)
    assert len(srv.bodies) == 1 and client.take_retries() == 0


def test_what_may_not_be_sent_twice_is_retried_only_where_the_server_did_not_act(serve) -> None:
    """A session's begin re-sent after a 500 could open it twice: not retried; after a 503 it is."""
    srv, client = serve([500, 200])
    with pytest.raises(RolloutError, match=r"HTTP 500\): stand-in says 500"):
        client.begin_weight_update()
    srv, client = serve([0, 200])  # reset after it was sent: it may have been taken
    with pytest.raises(RolloutError, match="/begin_weight_update"):
        client.begin_weight_update()
    assert len(srv.bodies) == 1
    srv, client = serve([503, 200])
    assert client.begin_weight_update()["success"] and client.take_retries() == 1
    srv, client = serve([500, 502, 200])  # a load from disk is safe to repeat
    assert client.update_weights_from_disk("/ckpt", "v1")["success"] and client.take_retries() == 2
    assert srv.bodies[0] == srv.bodies[2] == {"model_path": "/ckpt", "weight_version": "v1"}


def test_health_polls_are_not_retried(serve) -> None:
    srv, client = serve([503, 200])
    assert client.health() is False and len(srv.bodies) == 1 and client.take_retries() == 0
    assert client.health() is True


def test_a_duplicate_rid_refusal_is_re_sent_under_the_next_attempts_rid(serve) -> None:
    """Released SGLang answers 400 to a rid still in flight (the original of a re-send, cut off by a reset):
    the re-send carries `<rid>-r1`, then `-r2` (derived from the content: the same in every run), with
    the same seeds; counted as retries. Control: any other 400 is not re-sent."""
    srv, client = serve([409, 409, 200])
    assert len(_generate(client)) == 2 and client.take_retries() == 2
    rid = srv.bodies[0]["rid"]
    assert [b["rid"] for b in srv.bodies] == [rid, f"{rid}-r1", f"{rid}-r2"]
    assert all({**b, "rid": rid} == srv.bodies[0] for b in srv.bodies)  # nothing else changed
    srv, client = serve([409])
    client.retries = 2
    with pytest.raises(RolloutError, match=r"HTTP 400 \(after 2 retries, bound: rollout.client_retries\): .*Dup"):
        _generate(client)
    assert [b["rid"][-3:] for b in srv.bodies[1:]] == ["-r1", "-r2"]


def test_the_retry_bound_is_a_validated_key_the_trainers_client_takes() -> None:
    from tonpolicy.config.compose import compose_config
    from tonpolicy.config.fleet_rules import check_fleet
    from tonpolicy.rollout.fleet import FleetClient, rollout_client

    fleet = rollout_client("http://127.0.0.1:1", ["http://127.0.0.1:2"], retries=1)
    assert isinstance(fleet, FleetClient) and {c.retries for c in (fleet.router, *fleet.replicas)} == {1}
    assert rollout_client("http://127.0.0.1:1", retries=0).retries == 0
    assert compose_config(["mode=plan"]).rollout.client_retries == 5
    for value, errors in ((-1, 1), (0, 0), (20, 0), (21, 1)):
        found: list[tuple[str, str]] = []
        check_fleet(
            compose_config(["mode=plan", f"rollout.client_retries={value}"]),
            lambda k, r, found=found: found.append((k, r)),
        )
        assert [k for k, _ in found] == ["rollout.client_retries"] * errors
        assert all("must be an integer in [0, 20]" in r for _, r in found)
