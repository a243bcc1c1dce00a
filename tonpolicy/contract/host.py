"""The host check for a job: the contract kernel set's invariances probed on this host at the job's
shapes (tonpolicy.kernels.invariant.host_check), by the launcher before anything starts and by every server and
trainer process before it computes (a node of a multi-node job may be another kind of CPU)."""

from __future__ import annotations

from tonpolicy.config.model import ModelConfig
from tonpolicy.config.schema import ContractConfig
from tonpolicy.contract.identity import build_info, kernel_params
from tonpolicy.cpu_numerics import describe_host
from tonpolicy.kernels.invariant.host_check import Failure, Shapes, probe_cached
from tonpolicy.kernels.invariant.ordered_gemm import OrderedKernelsUnavailable
from tonpolicy.kernels.sets import kernel_set


def kernel_problems(model: ModelConfig, kernels: str, params: dict, dtype: str) -> list[str]:
    """Why this host cannot run kernel set `kernels` (built with `params`) at the model's shapes."""
    if not kernel_set(kernels).host_probed:
        return []
    shapes = Shapes(
        hidden=model.hidden_size,
        intermediate=model.intermediate_size,
        heads=model.num_attention_heads,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        vocab=model.vocab_size,
        dtype=dtype,
        canonical_shards=params.get("canonical_shards", 4),
        attention_tile=params.get("attention_tile", 32),
    )
    try:
        failures = probe_cached(kernels, tuple(sorted(params.items())), shapes)
    except OrderedKernelsUnavailable as e:  # contract v2 on a host that cannot build its kernels
        return [str(e)]
    return failure_lines(failures)


def host_problems(model: ModelConfig, contract: ContractConfig) -> list[str]:
    """Why this host cannot run the contract at these shapes (empty: it can)."""
    if not contract.exact_zero:
        return []
    return kernel_problems(model, contract.kernels, kernel_params(contract), contract.dtype)


def failure_lines(failures: tuple[Failure, ...] | list[Failure]) -> list[str]:
    """One line per failure naming the CPU, the libraries, the shape and the property."""
    info = build_info("cpu")
    libs = "; ".join(info["blas"]) or "no BLAS reported"
    return [
        f"host check failed: {f.prop} at {f.shape}: {f.detail}, on {describe_host()}, torch {info['torch']} "
        f"(vector ISA {info['cpu_capability']}; {libs}); the contract's bits cannot be promised on this host"
        for f in failures
    ]
