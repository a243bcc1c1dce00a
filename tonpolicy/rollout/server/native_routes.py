"""SGLang's native endpoints on the embedded engine (names and shapes: tonpolicy.rollout.wire.request
and tonpolicy.rollout.wire.response): generate (plain, batched, n samples, streamed), weights, cache, info."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from tonpolicy.model.checkpoint import param_shapes
from tonpolicy.rollout.server.model import flush_cache, load_checked, reload_weights
from tonpolicy.rollout.server.state import (
    Response,
    ServerState,
    Stream,
    Submitted,
    not_ready,
    progress_events,
    run_items,
)
from tonpolicy.rollout.weight_group import DEFAULT_GROUP, FLATTENED_BUCKET, destroy, init_update_group, receive
from tonpolicy.rollout.wire.request import GenerateRequest, ProtocolError, parse_generate_request
from tonpolicy.rollout.wire.response import STREAM_END, build_generate_output, stream_chunk

log = logging.getLogger(__name__)

SERVER_VERSION = "tonpolicy-embedded-0.2"


def route_health(state: ServerState, body: Any) -> Response:
    return (200, None) if state.ready else (503, None)


def route_generate(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return not_ready()
    tokenize = state.tokenize if state.tokenizer is not None else None
    req = parse_generate_request(body, tokenize)
    sub = run_items(state, req.items, stream=req.stream)
    text_in_logprobs = isinstance(body, dict) and bool(body.get("return_text_in_logprobs"))
    decode = state.decode if state.tokenizer is not None else None

    def output(i: int, result: Any, version: str) -> dict[str, Any]:
        return build_generate_output(sub.rids[i], req.items[i], result, version, decode, text_in_logprobs)

    if req.stream:
        return 200, Stream(_stream(state, req, sub, output))
    batch = sub.future.result()
    outs = [output(i, res, batch.tag) for i, res in enumerate(batch.results)]
    return 200, (outs if req.is_batch else outs[0])


def _stream(state: ServerState, req: GenerateRequest, sub: Submitted, output: Any) -> Iterator[bytes]:
    try:
        for i, result in progress_events(sub):
            yield stream_chunk(output(i, result, state.weight_version), i if req.is_batch else None)
    except Exception as e:  # noqa: BLE001 - the status line is sent: SGLang reports it in the stream
        yield stream_chunk({"error": {"message": str(e), "type": "invalid_request_error", "code": 400}})
    yield STREAM_END


_UPDATE_FIELDS = {
    "model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache", "is_async",
    "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "manifest", "rid",
}  # fmt: skip


def route_update_weights_from_disk(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return not_ready()
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
        return 400, {"success": False, "message": _update_failure(path, e), "num_paused_requests": 0}
    message = "Succeeded to update model weights."
    if version is not None:
        message += f" Weight version updated to {version}."
    return 200, {"success": True, "message": message, "num_paused_requests": 0}


def _update_failure(path: str, e: Exception) -> str:
    """The reply names the checkpoint the client gave and what is wrong with it; the server's own
    file system details (resolved files, OS errors) go to the server log only."""
    if type(e) is ValueError:  # tonpolicy's own checks (architecture, shapes, index): written for users
        return f"Failed to update weights: {e}"
    log.error(f"update_weights_from_disk {path!r} failed: {type(e).__name__}: {e}")
    return f"Failed to update weights: cannot load a checkpoint from {path!r} ({type(e).__name__}; see the server log)"


_INIT_GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
_DISTRIBUTED_FIELDS = {
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
    "load_format", "selector", "torch_empty_cache", "rid",
}  # fmt: skip


def route_init_weights_update_group(state: ServerState, body: Any) -> Response:
    """Join the trainer's weight-update group as rank `rank_offset` (this engine is one rank)."""
    if not state.ready:
        return not_ready()
    if not isinstance(body, dict) or set(body) - _INIT_GROUP_FIELDS:
        raise ProtocolError(f"init_weights_update_group takes {sorted(_INIT_GROUP_FIELDS)}")
    try:
        address, port = str(body["master_address"]), int(body["master_port"])
        rank, world = int(body["rank_offset"]), int(body["world_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError("master_address, master_port, rank_offset and world_size are required") from e
    name, backend = str(body.get("group_name") or DEFAULT_GROUP), str(body.get("backend") or "nccl")
    if not 0 < rank < world:  # rank 0 is the trainer's: only it sends
        raise ProtocolError(f"rank_offset={rank} must be in [1, world_size={world})")
    if name in state.update_groups:
        raise ProtocolError(f"weight update group {name!r} already exists")
    try:
        state.update_groups[name] = init_update_group(backend, address, port, world, rank, name)
    except Exception as e:  # noqa: BLE001 - SGLang's {success, message} shape
        return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def route_update_weights_from_distributed(state: ServerState, body: Any) -> Response:
    """Receive the tensors the trainer broadcasts (names, dtypes, shapes announced here), between
    batches on the engine loop, then load them once all are checked."""
    if not state.ready:
        return not_ready()
    if not isinstance(body, dict) or set(body) - _DISTRIBUTED_FIELDS:
        raise ProtocolError(f"update_weights_from_distributed takes {sorted(_DISTRIBUTED_FIELDS)}")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
        len(names) == len(dtypes) == len(shapes)
    ):
        raise ProtocolError("names, dtypes and shapes must be lists of one length")
    group = state.update_groups.get(str(body.get("group_name") or DEFAULT_GROUP))
    if group is None:
        raise ProtocolError("no weight update group: call /init_weights_update_group first")
    if not state.weight_update_session:  # SGLang's rule (0.5.23): begin, update..., end
        return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                     "begin_weight_update() and end_weight_update()"}  # fmt: skip
    if body.get("load_format") not in (None, "auto", FLATTENED_BUCKET):
        raise ProtocolError(f"load_format {body['load_format']!r} is not supported")
    flattened = body.get("load_format") == FLATTENED_BUCKET  # one broadcast of all the bytes
    version = body.get("weight_version")

    def update(engine: Any) -> None:
        # Every rank must take the broadcast, even to refuse it; on the engine's device (NCCL: CUDA).
        tensors = receive(group, dtypes, shapes, device=state.args.device, flattened=flattened)
        # A flattened bucket carries part of the weights (SGLang loads what it is sent, too); whether
        # the session's buckets covered them all is checked at /end_weight_update.
        load_checked(engine, dict(zip(names, tensors, strict=True)), state.model_config, "the update", flattened)
        if flattened:
            state.bucket_names.update(names)
        flush_cache(engine)
        if version is not None:
            state.loop.tag = str(version)

    try:
        state.loop.call(update).result()
    except Exception as e:  # noqa: BLE001 - SGLang's {success, message} shape
        return 400, {"success": False, "message": f"Failed to update parameter online: {e}"}
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def route_begin_weight_update(state: ServerState, body: Any) -> Response:
    if state.weight_update_session:
        return 400, {"success": False, "message": "a weight-update session is already open; "
                     "call end_weight_update() first"}  # fmt: skip
    state.weight_update_session = True
    state.bucket_names = set()
    return 200, {"success": True, "message": "Success"}


def route_end_weight_update(state: ServerState, body: Any) -> Response:
    if not state.weight_update_session:
        return 400, {"success": False, "message": "no weight-update session is open; "
                     "call begin_weight_update() first"}  # fmt: skip
    state.weight_update_session = False
    missing = sorted(set(param_shapes(state.model_config)) - state.bucket_names) if state.bucket_names else []
    if missing:  # the served weights are a mix of old and new: say so, do not pass it as an update
        return 400, {"success": False, "message": f"the session's buckets left weights unsent: {missing[:8]}"}
    return 200, {"success": True, "message": "Success"}


def route_destroy_weights_update_group(state: ServerState, body: Any) -> Response:
    name = str((body or {}).get("group_name") or DEFAULT_GROUP) if isinstance(body, dict | None) else ""
    group = state.update_groups.pop(name, None)
    if group is None:
        return 400, {"success": False, "message": "The group to be destroyed does not exist."}
    destroy(group)
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def route_flush_cache(state: ServerState, body: Any) -> Response:
    if not state.ready:
        return not_ready()
    state.loop.call(flush_cache).result()
    return 200, "Cache flushed.\n"


def route_get_weight_version(state: ServerState, body: Any) -> Response:
    return 200, {"weight_version": state.weight_version}


def route_get_model_info(state: ServerState, body: Any) -> Response:
    info: dict[str, Any] = {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path if state.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
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
        "tokenizer_path": state.model_path if state.tokenizer is not None else None,
        "skip_tokenizer_init": state.tokenizer is None,
        "served_model_name": state.model_name,
        "dtype": a.dtype,
        "host": a.host,
        "port": state.port,
        "tp_size": 1,
        "dp_size": 1,
        "max_running_requests": a.max_running_requests,
        "chunked_prefill_size": a.chunked_prefill_size,
        "random_seed": a.random_seed,
        "weight_version": state.weight_version,
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
        return not_ready()
    a = state.args
    return 200, {
        "name": a.contract_name,
        "version": a.contract_version,
        "fingerprint": a.contract_fingerprint,
        "runtime": state.runtime,
    }


NATIVE_ROUTES = {
    ("GET", "/health"): route_health,
    ("GET", "/health_generate"): route_health,
    ("POST", "/generate"): route_generate,
    ("PUT", "/generate"): route_generate,
    ("GET", "/get_server_info"): route_get_server_info,
    ("GET", "/server_info"): route_get_server_info,  # SGLang's newer names, used by bench_serving
    ("GET", "/get_model_info"): route_get_model_info,
    ("GET", "/model_info"): route_get_model_info,
    ("GET", "/get_weight_version"): route_get_weight_version,
    ("GET", "/tonpolicy/contract"): route_tonpolicy_contract,
    ("GET", "/flush_cache"): route_flush_cache,
    ("POST", "/flush_cache"): route_flush_cache,
    ("POST", "/update_weights_from_disk"): route_update_weights_from_disk,
    ("POST", "/init_weights_update_group"): route_init_weights_update_group,
    ("POST", "/begin_weight_update"): route_begin_weight_update,
    ("POST", "/update_weights_from_distributed"): route_update_weights_from_distributed,
    ("POST", "/end_weight_update"): route_end_weight_update,
    ("POST", "/destroy_weights_update_group"): route_destroy_weights_update_group,
}
