"""Contract identity: name, version and a fingerprint over everything that affects numerics.

Both engines report the fingerprint; the launcher refuses to pair engines whose fingerprints differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tonpolicy.config.schema import ContractConfig

# Fields that change the bits. Name/version label the contract; supported_* only gate layouts.
NUMERICS_FIELDS = (
    "family",
    "kernels",
    "dtype",
    "accumulate_dtype",
    "attention_tile",
    "row_tile",
    "prefill_row_tile",
    "attention_row_tile",
    "canonical_shards",
    "logprob_recipe",
)
SGLANG_NUMERICS_FIELDS = ("enable_deterministic_inference", "attention_backend", "rl_on_policy_target")


@dataclass(frozen=True)
class ContractIdentity:
    name: str
    version: int
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "fingerprint": self.fingerprint}


def numerics(contract: ContractConfig) -> dict[str, Any]:
    from tonpolicy.kernels import get_kernels

    body = {f: getattr(contract, f) for f in NUMERICS_FIELDS}
    body["sglang"] = {f: getattr(contract.sglang, f) for f in SGLANG_NUMERICS_FIELDS}
    # The kernel set's own account of its dtype steps and reduction orders: a kernel change that
    # updates its description changes the fingerprint even when no config field moved.
    body["kernel_description"] = get_kernels(contract.kernels, **kernel_params(contract)).describe()
    return body


def fingerprint(contract: ContractConfig) -> str:
    canonical = json.dumps(numerics(contract), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def identity(contract: ContractConfig) -> ContractIdentity:
    return ContractIdentity(contract.name, contract.version, fingerprint(contract))


def kernel_params(contract: ContractConfig) -> dict[str, int]:
    """Keyword arguments for tonpolicy.kernels.get_kernels(contract.kernels, **params)."""
    return {
        "attention_tile": contract.attention_tile,
        "canonical_shards": contract.canonical_shards,
        "row_tile": contract.row_tile,
        "prefill_row_tile": contract.prefill_row_tile,
        "attention_row_tile": contract.attention_row_tile,
    }
