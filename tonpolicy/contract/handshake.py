"""Before the first step: does the rollout server run our contract with our numerics?"""

from __future__ import annotations

import logging
from typing import Any

from tonpolicy.config.rollout_backends import rollout_backend
from tonpolicy.config.schema import Config
from tonpolicy.contract.identity import identity, runtime_differences

log = logging.getLogger(__name__)


def handshake(cfg: Config, client: Any, ours_runtime: dict[str, Any]) -> str | None:
    """None when every server runs our contract with our numerics, else the reason to refuse. A fleet's
    client (rollout.replicas > 1) lists its servers in `replicas`: each is checked, whichever the
    router will send a sample to."""
    servers = getattr(client, "replicas", None)
    if not servers:
        return handshake_one(cfg, client, ours_runtime)
    for i, server in enumerate(servers):
        refusal = handshake_one(cfg, server, ours_runtime)
        if refusal:
            return f"replica {i} ({server.base_url}): {refusal}"
    return None


def handshake_one(cfg: Config, client: Any, ours_runtime: dict[str, Any]) -> str | None:
    """None when the server runs our contract with our numerics, else the reason to refuse.

    A tonpolicy server (embedded, or SGLang with the model package) reports the contract it was given
    and the runtime identity it computed from the kernel set it built; both must equal ours (the
    runtime fingerprint covers kernel parameters, dtype, torch build, device and BLAS). Stock SGLang
    reports none; there we check the server args that the contract renders, and the gate decides.
    """
    ours = identity(cfg.contract).to_dict()
    theirs = client.contract()
    if theirs is not None:
        label = {k: theirs.get(k) for k in ("name", "version", "fingerprint")}
        if theirs.get("fingerprint") != ours["fingerprint"]:
            return f"contract fingerprint mismatch: server {label} vs trainer {ours}"
        runtime = theirs.get("runtime") or {}
        if runtime.get("fingerprint") != ours_runtime["fingerprint"]:
            diff = runtime_differences(ours_runtime, runtime)
            return (
                f"runtime fingerprint mismatch: server {runtime.get('fingerprint')} vs trainer "
                f"{ours_runtime['fingerprint']}; differing parts (trainer, server): {diff}"
            )
        return None
    if rollout_backend(cfg.rollout.backend).reports_contract or cfg.contract.sglang.model_package:
        return f"the rollout server reports no tonpolicy contract (expected {ours})"
    info, policy = client.server_info(), cfg.contract.sglang
    expected = {
        "enable_deterministic_inference": policy.enable_deterministic_inference,
        "rl_on_policy_target": policy.rl_on_policy_target,
    }
    if policy.attention_backend is not None:
        expected["attention_backend"] = policy.attention_backend
    wrong = {k: info.get(k) for k, v in expected.items() if info.get(k) != v}
    if wrong:
        return f"SGLang server args {wrong} differ from contract {cfg.contract.name}'s {expected}"
    log.info(
        f"tonpolicy: stock SGLang's server args match contract {cfg.contract.name}; parity is measured by the gate"
    )
    return None
