"""The rollout-backend registry: what each `rollout.backend` is and needs, readable without importing torch.

Every place that behaves differently per backend (validation, the plan, the launcher, the weight sync,
the handshake) reads a field here instead of comparing names, so adding a backend is one
`register_rollout_backend` call (plus its server). The server's command and environment builders live
with the launcher; they are named as "module:function" and imported only when a plan is rendered.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.config.sglang_rules import check_sglang, sglang_python


@dataclass(frozen=True)
class RolloutBackend:
    """One rollout backend (fields are facts, never derived from the name).

    server_command: "module:function" of (cfg, run_dir, model_path, device, port) -> the server's argv,
        whose first item is "python" where the launcher fills in the interpreter.
    server_environment: "module:function" of (cfg, device, fingerprint) -> the server process's own
        environment (None: it needs none beyond the job's).
    interpreter: (cfg) -> the interpreter the trainer must share with the server (one torch build for
        both engines); None: the launcher's own.
    engine_ranks: (cfg) -> ranks one server puts in the weight-sync group.
    reports_port: the server writes the port it bound to a file (--port-file); else the launcher picks a
        free port and passes it.
    sharded: the server runs parallel.rollout_tp / rollout_ep > 1.
    spans_nodes: one server may run on several nodes (rollout.nnodes > 1).
    decode_graphs: rollout.cuda_graphs applies (the engine's own decode graphs).
    reports_contract: the server always reports tonpolicy's contract; a released server does only with
        the contract's model package.
    family_served: (family entry) -> whether the server serves that model family.
    rules: (cfg, bad) -> the backend's own config rules, reported with every other violation."""

    name: str
    server_command: str
    server_environment: str | None
    interpreter: Callable[[Config], str] | None
    engine_ranks: Callable[[Config], int]
    reports_port: bool
    sharded: bool
    spans_nodes: bool
    decode_graphs: bool
    reports_contract: bool
    family_served: Callable[[Any], bool]
    rules: Callable[[Config, Any], None] | None = None

    def command(self, cfg: Config, run_dir: Any, model_path: str, device: str, port: int) -> list[str]:
        return _resolve(self.server_command)(cfg, run_dir, model_path, device, port)

    def environment(self, cfg: Config, device: str, fingerprint: str) -> dict[str, str] | None:
        if self.server_environment is None:
            return None
        return _resolve(self.server_environment)(cfg, device, fingerprint)


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


_BACKENDS: dict[str, RolloutBackend] = {}


def register_rollout_backend(backend: RolloutBackend) -> None:
    if backend.name in _BACKENDS:
        raise ValueError(f"rollout backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend


def unregister_rollout_backend(name: str) -> None:
    _BACKENDS.pop(name, None)


def rollout_backend(name: str) -> RolloutBackend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"rollout.backend={name!r}: unknown rollout backend; known: {', '.join(_BACKENDS)}") from None


def rollout_backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


register_rollout_backend(
    RolloutBackend(
        name="embedded",
        server_command="tonpolicy.launch.plan:embedded_server_argv",
        server_environment=None,
        interpreter=None,
        engine_ranks=lambda cfg: 1,
        reports_port=True,
        sharded=False,
        spans_nodes=False,
        decode_graphs=True,
        reports_contract=True,
        family_served=lambda family: True,
    )
)
register_rollout_backend(
    RolloutBackend(
        name="sglang",
        server_command="tonpolicy.launch.plan:sglang_server_argv",
        server_environment="tonpolicy.launch.sglang_env:server_environment",
        interpreter=sglang_python,
        engine_ranks=lambda cfg: cfg.parallel.rollout_tp,
        reports_port=False,
        sharded=True,
        spans_nodes=True,
        decode_graphs=False,
        reports_contract=False,
        family_served=lambda family: family.sglang_entry is not None,
        rules=check_sglang,
    )
)
