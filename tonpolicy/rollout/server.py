"""tonpolicy's embedded rollout server: SGLang's native HTTP protocol around the embedded engine.

    python -m tonpolicy.rollout.server --config resolved_config.yaml [--port 0 --port-file PATH]
    python -m tonpolicy.rollout.server --model-path CKPT --kernels contract --dtype bfloat16 \\
        --contract-name qwen3_dense_v1 --contract-version 1 --contract-fingerprint SHA256

Endpoints (SGLang names and shapes, see tonpolicy.rollout.protocol): `POST|PUT /generate`,
`GET /health` (and `/health_generate`), `GET /get_server_info`, `GET /get_model_info`,
`GET /get_weight_version`, `GET|POST /flush_cache`, `POST /update_weights_from_disk`.
`/get_server_info` also carries `tonpolicy_contract` {name, version, fingerprint} (the contract it was
given), and `GET /tonpolicy/contract` adds `runtime`: the identity the server computed from the kernel
set it built (kernel description, dtype, torch build, device), which the trainer compares with its own.

It binds 127.0.0.1 on a free port unless told otherwise, prints
`tonpolicy rollout server listening on http://HOST:PORT` and writes PORT to `--port-file`, then loads
the model; `/health` answers 503 until the engine is ready. HTTP handler threads feed one engine
loop thread (tonpolicy.rollout.engine_loop), so concurrent requests are batched together.

Exit codes: 0 after SIGTERM, 130 after Ctrl-C, 1 when the model cannot be loaded or the engine loop
dies, 2 for bad arguments, 3 when the address cannot be bound (port taken).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import signal
import sys
import threading
import traceback
import uuid
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tonpolicy.config.model import ModelConfig
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.rollout.engine_loop import EngineLoop
from tonpolicy.rollout.protocol import (
    GenerateItem,
    ProtocolError,
    build_generate_output,
    finish_reason_json,
    parse_generate_request,
)
from tonpolicy.rollout.server_args import ServerArgs, parse_server_args
from tonpolicy.rollout.server_model import (
    build_engine,
    flush_cache,
    reload_weights,
    result_fields,
    to_gen_request,
)

EXIT_LOAD_FAILED = 1
EXIT_BIND_FAILED = 3
SERVER_VERSION = "tonpolicy-embedded-0.1"
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body larger than this gets 413, nothing is allocated

Response = tuple[int, Any]  # (status, JSON-able body | str | None)


class ServerState:
    """What the handlers share: the arguments, the engine loop once loaded, and bookkeeping."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.loop: EngineLoop | None = None
        self.model_config: ModelConfig | None = None  # set once the model is loaded
        # Computed from the kernel set the engine built, once it is built (never taken from flags).
        self.runtime: dict[str, Any] | None = None
        self.model_path: str | None = args.model_path
        self.port: int = args.port
        self._seeds = itertools.count()
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.loop is not None and self.loop.is_alive()

    def next_seed(self) -> int:
        # Requests without sampling_seed still get distinct, reproducible seeds (in arrival order).
        with self._lock:
            return self.args.random_seed + next(self._seeds)


# --- routes -----------------------------------------------------------------------------------


def _not_ready() -> Response:
    return 503, {"error": {"message": "the engine is not ready"}}


def route_health(state: ServerState, body: Any) -> Response:
    return (200, None) if state.ready else (503, None)


def route_generate(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return _not_ready()
    items, is_batch = parse_generate_request(body)
    # Checked here, not by the engine: one bad request must not fail the others batched with it.
    cfg = state.model_config
    for it in items:
        if max(it.input_ids) >= cfg.vocab_size or min(it.input_ids) < 0:
            raise ProtocolError(f"input_ids must be in [0, {cfg.vocab_size})")
        if len(it.input_ids) + it.sampling.max_new_tokens > cfg.max_position_embeddings:
            raise ProtocolError(
                f"prompt ({len(it.input_ids)}) + max_new_tokens ({it.sampling.max_new_tokens}) exceeds "
                f"the context length {cfg.max_position_embeddings}"
            )
    seeds = [
        it.sampling.sampling_seed if it.sampling.sampling_seed is not None else state.next_seed()
        for it in items
    ]
    batch = state.loop.generate(
        [to_gen_request(it, seed) for it, seed in zip(items, seeds, strict=True)]
    ).result()
    outs = [_output(it, res, batch.tag) for it, res in zip(items, batch.results, strict=True)]
    return 200, (outs if is_batch else outs[0])


def _output(item: GenerateItem, result: Any, weight_version: str) -> dict[str, Any]:
    rid = item.rid or uuid.uuid4().hex  # SGLang's default rid
    ids, lps, kind = result_fields(result)
    finish = finish_reason_json(kind, ids, item.sampling.max_new_tokens)
    return build_generate_output(rid, item, ids, lps, finish, weight_version)


_UPDATE_FIELDS = {
    "model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache", "is_async",
    "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "manifest", "rid",
}  # fmt: skip


def route_update_weights_from_disk(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return _not_ready()
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        raise ProtocolError("model_path is required")
    unknown = set(body) - _UPDATE_FIELDS
    if unknown:
        raise ProtocolError(f"unknown update_weights_from_disk fields {sorted(unknown)}")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        raise ProtocolError(f"load_format {body['load_format']!r} is not supported")
    path, version = body["model_path"], body.get("weight_version")

    def reload(engine: Any) -> None:
        # Runs on the engine loop between batches: no request ever sees half-loaded weights.
        reload_weights(engine, path, state.model_config)
        state.model_path = path
        if version is not None:
            state.loop.tag = str(version)

    try:
        state.loop.call(reload).result()
    except Exception as e:  # noqa: BLE001 - reported in SGLang's {success, message} shape
        return 400, {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
    message = "Succeeded to update model weights."
    if version is not None:
        message += f" Weight version updated to {version}."
    return 200, {"success": True, "message": message, "num_paused_requests": 0}


def route_flush_cache(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return _not_ready()
    state.loop.call(flush_cache).result()
    return 200, "Cache flushed.\n"


def route_get_weight_version(state: ServerState, body: Any) -> Response:
    return 200, {"weight_version": _weight_version(state)}


def _weight_version(state: ServerState) -> str:
    return state.loop.tag if state.loop is not None else state.args.weight_version


def route_get_model_info(state: ServerState, body: Any) -> Response:
    info: dict[str, Any] = {
        "model_path": state.model_path,
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": _weight_version(state),
    }
    if state.model_config is not None:  # tonpolicy extension: the architecture numbers
        info["model_config"] = asdict(state.model_config)
    return 200, info


def route_get_server_info(state: ServerState, body: Any) -> Response:
    a = state.args
    loop = state.loop
    return 200, {
        # SGLang ServerArgs names where one exists.
        "model_path": state.model_path,
        "tokenizer_path": None,
        "skip_tokenizer_init": True,
        "dtype": a.dtype,
        "host": a.host,
        "port": state.port,
        "tp_size": 1,
        "dp_size": 1,
        "max_running_requests": a.max_running_requests,
        "chunked_prefill_size": a.chunked_prefill_size,
        "random_seed": a.random_seed,
        "weight_version": _weight_version(state),
        "internal_states": [
            {
                "engine": "tonpolicy-embedded",
                "ready": state.ready,
                "batches_run": loop.batches_run if loop else 0,
                "requests_run": loop.requests_run if loop else 0,
                "largest_batch": loop.largest_batch if loop else 0,
            }
        ],
        "version": SERVER_VERSION,
        # tonpolicy's own: the numerics the engine runs under.
        "tonpolicy_contract": {
            "name": a.contract_name,
            "version": a.contract_version,
            "fingerprint": a.contract_fingerprint,
        },
        "kernels": a.kernels,
        "kernel_params": a.kernel_params,
    }


def route_tonpolicy_contract(state: ServerState, body: Any) -> Response:
    if state.runtime is None:
        return _not_ready()
    a = state.args
    return 200, {"name": a.contract_name, "version": a.contract_version, "fingerprint": a.contract_fingerprint,
                 "runtime": state.runtime}


ROUTES = {
    ("GET", "/health"): route_health,
    ("GET", "/health_generate"): route_health,
    ("POST", "/generate"): route_generate,
    ("PUT", "/generate"): route_generate,
    ("GET", "/get_server_info"): route_get_server_info,
    ("GET", "/get_model_info"): route_get_model_info,
    ("GET", "/get_weight_version"): route_get_weight_version,
    ("GET", "/tonpolicy/contract"): route_tonpolicy_contract,
    ("GET", "/flush_cache"): route_flush_cache,
    ("POST", "/flush_cache"): route_flush_cache,
    ("POST", "/update_weights_from_disk"): route_update_weights_from_disk,
}


# --- HTTP plumbing ----------------------------------------------------------------------------


class RolloutHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # listen backlog: socketserver's 5 drops bursts of concurrent clients

    def __init__(self, address: tuple[str, int], state: ServerState) -> None:
        self.state = state
        super().__init__(address, RolloutHandler)


class RolloutHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the trainer reuses one connection
    server: RolloutHTTPServer

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        route = ROUTES.get((method, path))
        if route is None:
            known = any(p == path for _, p in ROUTES)
            status = 405 if known else 404
            self._send(
                status,
                {"error": {"message": f"{method} {path}: {'method not allowed' if known else 'not found'}"}},
            )
            return
        try:
            status, body = route(self.server.state, self._read_json())
        except ProtocolError as e:
            status, body = e.status, {"error": {"message": str(e)}}
        except Exception as e:  # noqa: BLE001 - a failed request must not take the server down
            traceback.print_exc()  # the server log is where an orchestrator looks
            status, body = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        self._send(status, body)

    def _read_json(self) -> Any:
        header = self.headers.get("Content-Length") or "0"
        if not header.strip().isdigit():  # also refuses "-1", which would block a read forever
            self.close_connection = True
            raise ProtocolError(f"Content-Length {header!r} is not a non-negative integer")
        length = int(header)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise ProtocolError(f"request body of {length} bytes exceeds {MAX_BODY_BYTES}", status=413)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return None
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ProtocolError(f"request body is not UTF-8: {e}") from e
        except json.JSONDecodeError as e:
            raise ProtocolError(f"request body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise ProtocolError("request body nests too deeply") from e

    def _send(self, status: int, body: Any) -> None:
        if body is None:
            data, ctype = b"", "text/plain"
        elif isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            # Python's json writes floats with repr(): an fp32 logprob comes back bit-exact.
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.state.args.log_requests:
            super().log_message(format, *args)


# --- process ----------------------------------------------------------------------------------


def write_port_file(path: str, port: int) -> None:
    # Atomic: an orchestrator polling the file never reads a half-written port.
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, target)


def bind(state: ServerState) -> RolloutHTTPServer | None:
    a = state.args
    try:
        return RolloutHTTPServer((a.host, a.port), state)
    except OSError as e:
        why = "the port is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        print(
            f"tonpolicy rollout server: cannot listen on {a.host}:{a.port}: {why}. "
            "Stop the other process, pick another --port, or use --port 0 for a free one.",
            file=sys.stderr,
            flush=True,
        )
        return None


def serve(args: ServerArgs) -> int:
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    state = ServerState(args)
    httpd = bind(state)
    if httpd is None:
        return EXIT_BIND_FAILED
    state.port = httpd.server_address[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=httpd.serve_forever, name="tonpolicy-http", daemon=True).start()
    if args.port_file:
        write_port_file(args.port_file, state.port)
    print(f"tonpolicy rollout server listening on http://{args.host}:{state.port}", flush=True)
    try:
        try:
            engine, state.model_config = build_engine(args)
            weight = engine.model.model.embed_tokens.weight
            state.runtime = runtime_identity(engine.model.kernels, args.dtype, weight.device.type)
        except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
            print(
                f"tonpolicy rollout server: cannot load the model: {type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_LOAD_FAILED
        loop = EngineLoop(engine)
        loop.tag = args.weight_version
        loop.start()
        state.loop = loop
        print(
            f"tonpolicy rollout server ready (contract {args.contract_name} {args.contract_fingerprint[:16]})",
            flush=True,
        )
        while not stop.wait(0.5):
            if not loop.is_alive():
                print(
                    f"tonpolicy rollout server: the engine loop died: {loop.error!r}",
                    file=sys.stderr,
                    flush=True,
                )
                return EXIT_LOAD_FAILED
        loop.stop()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        httpd.shutdown()
        httpd.server_close()


def main(argv: list[str] | None = None) -> int:
    return serve(parse_server_args(argv))


if __name__ == "__main__":
    sys.exit(main())
