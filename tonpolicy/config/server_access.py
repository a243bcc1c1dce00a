"""Who may reach the rollout server: the loopback addresses it binds by default, and the environment
variable that carries its API key (never written to the config)."""

from __future__ import annotations

import os
from typing import Any

from tonpolicy.config.schema import Config

LOOPBACK = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "TONPOLICY_API_KEY"


def check_server_access(cfg: Config, bad: Any) -> None:
    """A server reachable from other hosts must mean it and require the key."""
    r = cfg.rollout
    if r.host not in LOOPBACK and not (r.allow_remote and r.require_api_key):
        bad(
            "rollout.host",
            "binds a non-loopback address, exposing /generate and the weight endpoints to "
            "other hosts; set rollout.allow_remote=true to mean it and rollout.require_api_key=true (with "
            f"${API_KEY_ENV}) so only the trainer is served (torchrun's store listens on all interfaces "
            "either way)",
        )
    if r.require_api_key and cfg.mode != "plan" and not os.environ.get(API_KEY_ENV):
        bad("rollout.require_api_key", f"needs the key in ${API_KEY_ENV} (it is never written to the config)")
