"""Contract identity: name, version and a fingerprint over everything that affects numerics.

Both engines report the fingerprint; the launcher refuses to pair engines whose fingerprints differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tonpolicy.config.schema import ContractConfig
from tonpolicy.cpu_numerics import cpu_info, isa_caps
from tonpolicy.families import FAMILIES

# The environment variable that hands the contract (JSON: contract_env) to SGLang's model processes.
CONTRACT_ENV = "TONPOLICY_CONTRACT"
# Contract fields handed to tonpolicy.kernels.get_kernels as keyword arguments.
KERNEL_PARAM_FIELDS = (
    "attention_tile",
    "canonical_shards",
    "row_tile",
    "prefill_row_tile",
    "logits_dtype",
    "quant",
)
# Fields that change the bits. Name/version label the contract; supported_* only gate layouts.
NUMERICS_FIELDS = (
    "family",
    "kernels",
    "dtype",
    "accumulate_dtype",
    *KERNEL_PARAM_FIELDS,
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
    # Whether SGLang runs the contract model package (its numerics are then the kernel set's, described
    # below), not where the package lives: moving a module changes no bit.
    body["sglang"]["contract_model_package"] = contract.sglang.model_package is not None
    # The kernel set's own account of its dtype steps and reduction orders: a kernel change that
    # updates its description changes the fingerprint even when no config field moved.
    kernels = get_kernels(contract.kernels, **kernel_params(contract))
    body["kernel_description"] = kernels.describe()
    if contract.family in FAMILIES and FAMILIES[contract.family].routed_experts:
        body["moe_description"] = kernels.describe_moe()
    return body


def fingerprint(contract: ContractConfig) -> str:
    canonical = json.dumps(numerics(contract), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def identity(contract: ContractConfig) -> ContractIdentity:
    return ContractIdentity(contract.name, contract.version, fingerprint(contract))


def kernel_params(contract: ContractConfig) -> dict[str, int]:
    """Keyword arguments for tonpolicy.kernels.get_kernels(contract.kernels, **params)."""
    return {f: getattr(contract, f) for f in KERNEL_PARAM_FIELDS}


# --- runtime identity: what an engine actually built ------------------------------------------------


def build_info(device: str) -> dict[str, Any]:
    """The parts of this process's build that decide bits: torch, its BLAS/oneDNN, the CPU's vector
    ISA, and the accelerator when there is one."""
    import torch

    config = torch.__config__.show()
    libs = [
        line.strip(" -")
        for line in config.splitlines()
        if any(lib in line for lib in ("Math Kernel Library", "MKL-DNN", "oneDNN", "OpenBLAS"))
        and "Build settings" not in line
    ]
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "device": device,
        "blas": libs,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # The CPU class and the caps on its libraries' dispatch: the paths torch's vectorised ops take
        # (the contract GEMM is the same on every CPU; exp and fixed-length sums follow these).
        "cpu": {k: v for k, v in cpu_info().items() if k in ("vendor", "flags")},
        "isa_caps": isa_caps(),
    }
    if device == "cuda":
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name()
    return info


def definition_build(kernels: Any, device: str) -> dict[str, Any]:
    """The build of a kernel set whose bits are its definition's alone (every GEMM, exp, log and sum its
    own code): the device and a digest of that code. Torch, its libraries and the CPU class decide no
    bit there, so they are left out: engines on other CPU classes or torch builds pair."""
    return {"device": device, "kernel_library": kernels.library_digest()}


def runtime_identity(kernels: Any, dtype: str, device: str) -> dict[str, Any]:
    """Fingerprint of a built engine: the kernel set's own description (every tile size, shard count,
    reduction order and the logprob recipe), the model dtype and the build. Each engine computes it
    from the kernel set it constructed, so two engines agree only when they really run the same
    numerics; the trainer refuses a rollout server whose runtime fingerprint differs from its own. The
    build is the host's (torch, BLAS, CPU class) where library code decides bits, and the kernel
    library's digest where the set owns all of its arithmetic (`bits_depend_on_host` False)."""
    owned = device == "cpu" and not getattr(kernels, "bits_depend_on_host", True)
    build = definition_build(kernels, device) if owned else build_info(device)
    body = {"kernels": kernels.describe(), "dtype": dtype, "build": build}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"fingerprint": digest, **body}


def runtime_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Which parts of two runtime identities differ: {path: (ours, theirs)}."""
    out: dict[str, Any] = {}
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out |= {f"{key}.{k}": v for k, v in runtime_differences(a, b).items()}
        elif a != b and key != "fingerprint":
            out[key] = (a, b)
    return out
