"""tonpolicy's embedded rollout server: SGLang's native HTTP protocol around the embedded engine.

    python -m tonpolicy.rollout.server --config resolved_config.yaml [--port 0 --port-file PATH]
    python -m tonpolicy.rollout.server --model-path CKPT --kernels contract --dtype bfloat16 \\
        --contract-name qwen3_dense_v2 --contract-version 2 --contract-fingerprint SHA256

Endpoints: SGLang's native ones (tonpolicy.rollout.server.native_routes: `POST|PUT /generate`, `GET /health`
(and `/health_generate`), `GET /get_server_info` (`/server_info`), `GET /get_model_info`
(`/model_info`), `GET /get_weight_version`, `GET|POST /flush_cache`, `POST /update_weights_from_disk`)
and OpenAI-compatible ones (tonpolicy.rollout.server.openai_routes: `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions`). With a tokenizer in the checkpoint (and no
`--skip-tokenizer-init`) it takes text prompts and answers with text, as SGLang does.
`/get_server_info` also carries `tonpolicy_contract` {name, version, fingerprint} (the contract it was
given), and `GET /tonpolicy/contract` adds `runtime`: the identity the server computed from the kernel
set it built (kernel description, dtype, torch build, device), which the trainer compares with its own.

It binds 127.0.0.1 on a free port unless told otherwise, prints
`tonpolicy rollout server listening on http://HOST:PORT` and writes PORT to `--port-file`, then loads
the model; `/health` answers 503 until the engine is ready. HTTP handler threads feed one engine
loop thread (tonpolicy.rollout.engine.loop), so concurrent requests are batched together.

Exit codes: 0 after SIGTERM, 130 after Ctrl-C, 1 when the model cannot be loaded or the engine loop
dies, 2 for bad arguments, 3 when the address cannot be bound (port taken).
"""

from __future__ import annotations

import _thread
import errno
import json
import logging
import secrets
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from tonpolicy.contract.identity import runtime_identity
from tonpolicy.files import write_atomic
from tonpolicy.model.tokenizer import load_text_tokenizer
from tonpolicy.rollout.engine.loop import EngineLoop
from tonpolicy.rollout.server.args import ServerArgs, parse_server_args
from tonpolicy.rollout.server.model import build_engine
from tonpolicy.rollout.server.native_routes import NATIVE_ROUTES
from tonpolicy.rollout.server.openai_routes import OPENAI_ROUTES
from tonpolicy.rollout.server.state import ServerState, Stream
from tonpolicy.rollout.wire.request import ProtocolError

log = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 1
EXIT_BIND_FAILED = 3
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body larger than this gets 413, nothing is allocated
ROUTES = {**NATIVE_ROUTES, **OPENAI_ROUTES}


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
        if not self._authorized(path):
            self.close_connection = True
            self._send(401, {"error": {"message": "Unauthorized: this server needs Authorization: Bearer <api key>"}})
            return
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

    def _authorized(self, path: str) -> bool:
        """SGLang's rule: with an API key, every route but /health* needs it as a bearer token."""
        key = self.server.state.args.api_key
        if not key or path.startswith("/health"):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())

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
        if isinstance(body, Stream):
            self._send_stream(body)
            return
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

    def _send_stream(self, stream: Stream) -> None:
        """Server-sent events in HTTP/1.1 chunks, each written as soon as it is made."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for data in stream.chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client left; its requests still finish
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.state.args.log_requests:
            super().log_message(format, *args)


# --- process ----------------------------------------------------------------------------------


def write_port_file(path: str, port: int) -> None:
    write_atomic(path, f"{port}\n")  # an orchestrator polling the file never reads half a port


def bind(state: ServerState) -> RolloutHTTPServer | None:
    a = state.args
    try:
        return RolloutHTTPServer((a.host, a.port), state)
    except OSError as e:
        why = "the port is already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        log.error(
            f"tonpolicy rollout server: cannot listen on {a.host}:{a.port}: {why}. "
            "Stop the other process, pick another --port, or use --port 0 for a free one."
        )
        return None


def _stop_on(stop: threading.Event, loop: EngineLoop, grace_s: float = 10.0) -> None:
    """Once `stop` is set (SIGTERM's handler only sets it: a handler must not take the queue's lock the
    main thread may hold), let the requests in flight finish for up to `grace_s`, then interrupt."""
    stop.wait()
    loop.request_stop()
    time.sleep(grace_s)
    if loop.is_alive():
        _thread.interrupt_main()


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
    log.info(f"tonpolicy rollout server listening on http://{args.host}:{state.port}")
    try:
        try:
            engine, state.model_config = build_engine(args)
            if not args.skip_tokenizer_init:
                state.tokenizer = load_text_tokenizer(args.model_path)
            if state.tokenizer is not None:  # SGLang stops at the tokenizer's EOS (unless ignore_eos)
                engine.eos_token_id = state.tokenizer.eos_token_id
            weight = engine.model.model.embed_tokens.weight
            state.runtime = runtime_identity(engine.model.kernels, args.dtype, weight.device.type)
        except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
            log.error(f"tonpolicy rollout server: cannot load the model: {type(e).__name__}: {e}")
            return EXIT_LOAD_FAILED
        loop = EngineLoop(engine)
        loop.tag = args.weight_version
        state.loop = loop
        threading.Thread(target=_stop_on, args=(stop, loop), name="tonpolicy-stop", daemon=True).start()
        try:
            loop.run(  # the engine steps on the main thread: see tonpolicy.rollout.engine.loop
                on_start=lambda: log.info(
                    f"tonpolicy rollout server ready (contract {args.contract_name} {args.contract_fingerprint[:16]})"
                )
            )
        except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
            log.error(f"tonpolicy rollout server: the engine loop died: {e!r}")
            return EXIT_LOAD_FAILED
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
