"""The trainer's client for a rollout server: tonpolicy's embedded server or real SGLang alike.

It sends only fields SGLang's native API defines (GenerateReqInput, SamplingParams,
UpdateWeightFromDiskReqInput) and reads only fields SGLang answers with, so the same code drives
both. HTTP through urllib3 (no torch, no engine), whose `Retry` re-sends a request that failed on the
way (connection refused or reset, a 5xx from a server or router restarting) with bounded exponential
backoff; a request that still fails after the bound is a RolloutError naming the cause.

Only what is safe to send twice is retried on anything the server may have acted on: reads, a seeded
/generate (the same `rid` and seeds: the same samples wherever it runs), a load from disk, a cache
flush. The weight-update group's calls (joining a collective, a session's begin/end) are re-sent only
when the server cannot have acted: the connection was never made, or it answered 503. Health polls
are never retried: their callers poll.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import urllib3
from urllib3.exceptions import MaxRetryError, ReadTimeoutError
from urllib3.util.retry import Retry

from tonpolicy.rollout.wire.response import parse_generate_output

# Re-sends of one request, and the backoff between them: no wait before the first, then
# backoff_s * 2, * 4, ... up to BACKOFF_MAX_S (urllib3's schedule).
RETRIES = 5
BACKOFF_S = 0.5
BACKOFF_MAX_S = 10.0
# Statuses a restarting server or router answers; for a request that is not safe to send twice, only
# 503 (the server says it did not take the request).
RETRY_STATUSES = frozenset({500, 502, 503, 504})
UNSENT_STATUSES = frozenset({503})
# Connections kept per server: a fleet's client sends up to 64 samples at once through one router.
MAX_CONNECTIONS = 64


class RolloutError(RuntimeError):
    """The server answered with an error, or not at all."""


class _CountedRetry(Retry):
    """urllib3's Retry that reports every re-send it allows (`on_retry`), so the client can count them."""

    on_retry: Callable[[], None] | None = None

    def new(self, **kw: Any) -> Self:
        fresh = super().new(**kw)
        fresh.on_retry = self.on_retry
        return fresh

    def increment(self, *args: Any, **kwargs: Any) -> Self:
        if isinstance(kwargs.get("error"), ReadTimeoutError):
            raise kwargs["error"]  # a server that used the whole timeout is not restarting: no re-send
        fresh = super().increment(*args, **kwargs)  # MaxRetryError (or the error) once it may not retry
        if self.on_retry is not None:
            self.on_retry()
        return fresh


def generate_rid(body: dict[str, Any]) -> str:
    """A /generate request's rid, from its content: a re-sent request carries the same one. A string (the
    router takes no list): SGLang and the embedded server give a batch's prompts `<rid>_<i>`, distinct."""
    return "tonpolicy-" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]


# Released SGLang refuses a request whose rid is still in flight (its original, cut off from the client
# by a reset, may still be running there): the re-send then carries the next attempt's rid.
DUPLICATE_RID = "Duplicate request ID"


def attempt_rid(rid: str, attempt: int) -> str:
    """The rid of a re-sent /generate after a duplicate-rid refusal: derived from the content's rid and
    the attempt, so a run's requests stay the same from one run to the next (the seeds decide the bits)."""
    return rid if attempt == 0 else f"{rid}-r{attempt}"


def _after(retries: int) -> str:
    return f" (after {retries} retries, bound: rollout.client_retries)" if retries else ""


class _Answer:
    """A server's answer, and how many times the request was re-sent to get it."""

    def __init__(self, status: int, raw: bytes, retries: int) -> None:
        self.status, self.raw, self.retries = status, raw, retries

    def text(self) -> str:
        return self.raw.decode(errors="replace")[:2000]

    def after(self) -> str:
        return _after(self.retries)


class RolloutClient:
    """`retries`: re-sends of one request at most (0: none); `backoff_s`: urllib3's backoff factor."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        retries: int = RETRIES,
        backoff_s: float = BACKOFF_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # Sent as a bearer token (SGLang's --api-key); default: $TONPOLICY_API_KEY, if set.
        self.api_key = api_key if api_key is not None else os.environ.get("TONPOLICY_API_KEY") or None
        self.retries, self.backoff_s = retries, backoff_s
        self._http = urllib3.PoolManager(maxsize=MAX_CONNECTIONS)
        self._lock = threading.Lock()  # the fleet's sample threads share one client
        self._retried = 0

    def take_retries(self) -> int:
        """Requests re-sent since the last call (a step record's `rollout_retries`)."""
        with self._lock:
            n, self._retried = self._retried, 0
        return n

    # --- transport --------------------------------------------------------------------------

    def _retry(self, safe: bool, on_retry: Callable[[], None]) -> Retry:
        retry = _CountedRetry(
            total=self.retries,
            read=None if safe else False,  # a reset after sending: the server may have acted
            other=None if safe else 0,
            status_forcelist=RETRY_STATUSES if safe else UNSENT_STATUSES,
            allowed_methods=None,  # every method: which requests are safe is decided per call here
            backoff_factor=self.backoff_s,
            backoff_max=BACKOFF_MAX_S,
            raise_on_status=False,  # the last answer comes back, and its status names the failure
            respect_retry_after_header=False,  # the backoff stays bounded whatever a server asks
        )
        retry.on_retry = on_retry
        return retry

    def _request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None, retry: bool | None = True
    ) -> _Answer:
        """`retry`: True for a request safe to send twice, False for one re-sent only where the server
        cannot have acted, None for none. A request that got no answer is a RolloutError."""
        headers = {}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"  # SGLang's FastAPI requires it
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        retries = 0

        def retried() -> None:
            nonlocal retries
            retries += 1
            with self._lock:
                self._retried += 1

        try:
            resp = self._http.request(
                method,
                self.base_url + path,
                body=data,
                headers=headers,
                timeout=timeout_s or self.timeout_s,
                retries=False if retry is None else self._retry(retry, retried),
                redirect=False,
            )
        except (urllib3.exceptions.HTTPError, OSError) as e:
            cause = e.reason if isinstance(e, MaxRetryError) else e
            raise RolloutError(f"{method} {self.base_url}{path}: {cause}{_after(retries)}") from e
        return _Answer(resp.status, resp.data, retries)

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        answer = self._request(method, path, body)
        if answer.status != 200:
            raise RolloutError(f"{method} {path} -> HTTP {answer.status}{answer.after()}: {answer.text()}")
        return json.loads(answer.raw)

    # --- endpoints --------------------------------------------------------------------------

    def health(self, timeout_s: float = 10.0) -> bool:
        try:
            return self._request("GET", "/health", timeout_s=timeout_s, retry=None).status == 200
        except RolloutError:
            return False

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.2, process: subprocess.Popen | None = None) -> None:
        """Block until /health answers 200. Raises TimeoutError, or RolloutError as soon as the
        server process (when given) has exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.health():
                return
            if process is not None and process.poll() is not None:
                raise RolloutError(f"the rollout server exited with code {process.returncode} before it was healthy")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base_url} was not healthy after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def generate(
        self,
        input_ids_batch: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
        return_routed_experts: bool = False,
    ) -> list[dict[str, Any]]:
        """One /generate call for a batch of prompts; `sampling_params` is shared or per prompt.

        Returns, in prompt order: {output_ids, output_logprobs (floats; fp32 values exactly),
        finish_reason ("length" | "stop" | ...), weight_version, routed_experts}; `routed_experts` (an
        MoE model's, asked for by `return_routed_experts`): base64 int32 [prompt+output-1 fed positions,
        layers, top_k] (`decode_routed_experts`), None when not asked for or not given.
        """
        batch = [[int(t) for t in p] for p in input_ids_batch]
        if not batch:
            return []
        sp = dict(sampling_params) if isinstance(sampling_params, dict) else [dict(s) for s in sampling_params]
        body: dict[str, Any] = {"input_ids": batch, "sampling_params": sp, "return_logprob": True}
        if return_routed_experts:  # only then: SGLang and the embedded server refuse it for a dense model
            body["return_routed_experts"] = True
        rid = generate_rid(body)  # re-sent, it is recognisably the same request
        retries = 0
        for attempt in range(self.retries + 1):
            body["rid"] = attempt_rid(rid, attempt)
            answer = self._request("POST", "/generate", body)
            retries += answer.retries
            if answer.status != 400 or DUPLICATE_RID not in answer.text() or attempt == self.retries:
                break
            with self._lock:
                self._retried += 1
            retries += 1
        if answer.status != 200:
            raise RolloutError(f"POST /generate -> HTTP {answer.status}{_after(retries)}: {answer.text()}")
        outs = json.loads(answer.raw)
        if not isinstance(outs, list) or len(outs) != len(batch):
            raise RolloutError(f"/generate answered {type(outs).__name__} for a batch of {len(batch)}")
        return [parse_generate_output(o) for o in outs]

    def server_info(self) -> dict[str, Any]:
        return self._json("GET", "/get_server_info")

    def model_info(self) -> dict[str, Any]:
        return self._json("GET", "/get_model_info")

    def contract(self) -> dict[str, Any] | None:
        """`GET /tonpolicy/contract`: the contract the server runs {name, version, fingerprint, runtime}
        (runtime: the identity it computed from the kernel set it built); None when the server has no
        such route (stock SGLang)."""
        got = self._request("GET", "/tonpolicy/contract")
        if got.status == 404:
            return None
        if got.status != 200:
            raise RolloutError(f"GET /tonpolicy/contract -> HTTP {got.status}{got.after()}: {got.text()}")
        return json.loads(got.raw)

    def _weights_call(self, path: str, body: dict[str, Any], safe: bool = False) -> dict[str, Any]:
        """A weights endpoint: SGLang answers {success, message}; anything else is a RolloutError.
        `safe`: the call may be sent twice (a load from disk); a group's or a session's may not."""
        got = self._request("POST", path, body, retry=safe)
        try:
            answer = json.loads(got.raw)
        except json.JSONDecodeError:
            answer = {"success": False, "message": got.raw.decode(errors="replace")}
        if got.status != 200 or not isinstance(answer, dict) or not answer.get("success"):
            # SGLang's {success: false, message}, or a refused request's {error: {message}}
            message = (answer.get("message") or (answer.get("error") or {}).get("message")
                       if isinstance(answer, dict) else answer)  # fmt: skip
            raise RolloutError(f"{path} failed (HTTP {got.status}){got.after()}: {message}")
        return answer

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._weights_call("/update_weights_from_disk", body, safe=True)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
        return self._weights_call("/init_weights_update_group", body)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": True}  # fmt: skip
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return self._weights_call("/update_weights_from_distributed", body)

    def begin_weight_update(self) -> dict[str, Any]:
        return self._weights_call("/begin_weight_update", {})

    def end_weight_update(self) -> dict[str, Any]:
        return self._weights_call("/end_weight_update", {})

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

    def flush_cache(self) -> None:
        got = self._request("POST", "/flush_cache")
        if got.status != 200:
            raise RolloutError(f"flush_cache -> HTTP {got.status}{got.after()}: {got.text()}")
