"""The trainer's client for a rollout server: tonpolicy's embedded server or real SGLang alike.

It sends only fields SGLang's native API defines (GenerateReqInput, SamplingParams,
UpdateWeightFromDiskReqInput) and reads only fields SGLang answers with, so the same code drives
both. Standard library only (urllib): the trainer ranks need no HTTP dependency.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from tonpolicy.rollout.wire.response import parse_generate_output


class RolloutError(RuntimeError):
    """The server answered with an error, or not at all."""


class RolloutClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # Sent as a bearer token (SGLang's --api-key); default: $TONPOLICY_API_KEY, if set.
        self.api_key = api_key if api_key is not None else os.environ.get("TONPOLICY_API_KEY") or None

    # --- transport --------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")  # SGLang's FastAPI requires it
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        try:
            status, raw = self._request(method, path, body)
        except (urllib.error.URLError, OSError) as e:
            raise RolloutError(f"{method} {self.base_url}{path}: {e}") from e
        if status != 200:
            raise RolloutError(f"{method} {path} -> HTTP {status}: {raw.decode(errors='replace')[:2000]}")
        return json.loads(raw)

    # --- endpoints --------------------------------------------------------------------------

    def health(self, timeout_s: float = 10.0) -> bool:
        try:
            status, _ = self._request("GET", "/health", timeout_s=timeout_s)
        except (urllib.error.URLError, OSError):
            return False
        return status == 200

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
        outs = self._json("POST", "/generate", body)
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
        try:
            status, raw = self._request("GET", "/tonpolicy/contract")
        except (urllib.error.URLError, OSError) as e:
            raise RolloutError(f"GET {self.base_url}/tonpolicy/contract: {e}") from e
        if status == 404:
            return None
        if status != 200:
            raise RolloutError(f"GET /tonpolicy/contract -> HTTP {status}: {raw.decode(errors='replace')[:2000]}")
        return json.loads(raw)

    def _weights_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A weights endpoint: SGLang answers {success, message}; anything else is a RolloutError."""
        try:
            status, raw = self._request("POST", path, body)
        except (urllib.error.URLError, OSError) as e:
            raise RolloutError(f"{path}: {e}") from e
        try:
            answer = json.loads(raw)
        except json.JSONDecodeError:
            answer = {"success": False, "message": raw.decode(errors="replace")}
        if status != 200 or not isinstance(answer, dict) or not answer.get("success"):
            # SGLang's {success: false, message}, or a refused request's {error: {message}}
            message = (answer.get("message") or (answer.get("error") or {}).get("message")
                       if isinstance(answer, dict) else answer)  # fmt: skip
            raise RolloutError(f"{path} failed (HTTP {status}): {message}")
        return answer

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._weights_call("/update_weights_from_disk", body)

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
        try:
            status, raw = self._request("POST", "/flush_cache")
        except (urllib.error.URLError, OSError) as e:
            raise RolloutError(f"flush_cache: {e}") from e
        if status != 200:
            raise RolloutError(f"flush_cache -> HTTP {status}: {raw.decode(errors='replace')}")
