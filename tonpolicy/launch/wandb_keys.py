"""The W&B names of the step record's fields: grouped panels as verl and slime chart them.

metrics.jsonl keeps the flat names (tests, resume and the tables read them); only the W&B boundary maps
them. docs/OBSERVABILITY.md holds the table.
"""

from __future__ import annotations

from typing import Any

# Exact names first; the suffix rules below catch the rest; what no rule names is the trainer's.
PARITY = {
    "tokens_scored",
    "mismatched_tokens",
    "max_abs_logprob_diff",
    "mean_abs_logprob_diff",
    "first_forward_mismatched",
    "first_forward_max_abs_diff",
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_max_abs_diff",
    "train_rollout_k3_kl",
    "token_mult_prob_error",
    "routing_agreement",
    "gate_samples",
    "is_ratio_mean",
    "is_ratio_max",
    "tis_truncated_frac",
    "exact",
    "gate",
    "gate_check",
    "recompute",
}
ROLLOUT = {
    "reward_mean",
    "model_tokens",
    "cached_tokens",
    "reward_errors",
    "rollout_retries",
    "policy_version",
    "trainer_policy_version",
    "max_staleness",
    "rollout_restarts",
    "requests_resent",
}
# Not charted: the step is the axis; `time` is an epoch timestamp (metrics.jsonl keeps it).
NOT_CHARTED = {"step", "time"}
NAMESPACES = ("parity", "rollout", "train", "timing", "perf", "eval")


def wandb_key(name: str) -> str:
    """The namespaced W&B key of a record field; a field that already names its panel keeps it."""
    if "/" in name:
        return name
    if name in PARITY:
        return f"parity/{name}"
    if name in ROLLOUT:
        return f"rollout/{name}"
    if name.endswith("_per_s") or name.startswith(("peak_", "cuda_")):
        return f"perf/{name}"
    if name.endswith("_s"):
        return f"timing/{name}"
    return f"train/{name}"


def split_record(record: dict[str, Any]) -> tuple[dict[str, float | int], dict[str, Any]]:
    """(charted numbers by W&B key, summary values by W&B key). Booleans, strings and lists are the
    summary's (a boolean charted is a 0/1 line that says nothing); nested tables stay in metrics.jsonl."""
    charted: dict[str, float | int] = {}
    summary: dict[str, Any] = {}
    for name, value in record.items():
        if name in NOT_CHARTED:
            continue
        if isinstance(value, bool) or isinstance(value, str):
            summary[wandb_key(name)] = value
        elif isinstance(value, int | float):
            charted[wandb_key(name)] = value
    return charted, summary
