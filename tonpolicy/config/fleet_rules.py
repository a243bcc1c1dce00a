"""A rollout fleet's rules (rollout.replicas servers behind sglang-router): its size, the client's re-sends,
the members' restarts, the router's policy."""

from __future__ import annotations

import importlib.util
from typing import Any

from tonpolicy.config.schema import Config

ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "power_of_two")
# Re-sends back off exponentially up to the client's cap: more than this only stretches a failing step.
MAX_CLIENT_RETRIES = 20
# A member that keeps dying is a bad node or a bad configuration, not a transient loss.
MAX_RESTARTS = 100


def check_fleet(cfg: Config, bad: Any) -> None:
    """rollout.replicas is the one name for rollout data parallelism (servers behind sglang-router)."""
    r = cfg.rollout
    if cfg.parallel.rollout_dp != 1:
        bad(
            "parallel.rollout_dp",
            "rollout data parallelism is a fleet of servers behind sglang-router: "
            f"use rollout.replicas={cfg.parallel.rollout_dp} (parallel.rollout_dp must stay 1)",
        )
    if r.replicas < 1:
        bad("rollout.replicas", "must be a positive integer (1: one server, no router)")
    if not 0 <= r.client_retries <= MAX_CLIENT_RETRIES:
        bad("rollout.client_retries", f"must be an integer in [0, {MAX_CLIENT_RETRIES}] (0: no re-sends)")
    if not 0 <= r.max_restarts <= MAX_RESTARTS:
        bad(
            "rollout.max_restarts",
            f"must be an integer in [0, {MAX_RESTARTS}] (0: a dead replica or router ends the run)",
        )
    if r.router_policy not in ROUTER_POLICIES:
        bad("rollout.router_policy", f"must be one of {list(ROUTER_POLICIES)} (sglang-router's --policy)")
    if r.replicas > 1 and r.nnodes > 1:
        bad("rollout.replicas", "a fleet of servers each spanning nodes (rollout.nnodes > 1) is not supported yet")
    if r.replicas > 1 and cfg.mode != "plan" and importlib.util.find_spec("sglang_router") is None:
        bad(
            "rollout.replicas",
            "needs sglang-router in the launcher's environment (pip install sglang-router==0.3.2; scripts/setup.sh)",
        )
