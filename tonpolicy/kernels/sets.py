"""The kernel-set registry: what each kernel set is and can do, readable without importing torch.

Every place that behaves differently per kernel set reads a field here instead of comparing names, so
adding a kernel set is one `register_kernel_set` call (plus its implementation module)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# The package that carries an invariant kernel set into released SGLang.
CONTRACT_SGLANG_PACKAGE = "tonpolicy.inside_sglang.model"
LOGITS_DTYPES = ("float32", "bfloat16")
# Construction parameters `get_kernels` knows; a spec lists the ones its set takes.
BUILD_PARAMS = ("attention_tile", "canonical_shards", "row_tile", "prefill_row_tile", "logits_dtype", "quant")
# contract.quant: "none", or "fp8_block" (block-scaled e4m3 linears, a choice of a set whose params take it).
QUANTS = ("none", "fp8_block")


@dataclass(frozen=True)
class KernelSetSpec:
    """One kernel set's capabilities (fields are facts, never derived from the name).

    devices: the torch device types it computes on ("cpu", "cuda").
    invariant: keeps the contract's invariances (exact-zero trainer/rollout logprob difference); the
        other sets are negative controls.
    bf16_logits: `logits_dtype="bfloat16"` (a native bf16 LM head GEMM) is a choice of this set.
    fixed_attention_tile: keys per attention tile when the set fixes it (None: a config choice).
    row_tile_multiple: `row_tile` (query rows per GEMM) must be a multiple of this, and `prefill_row_tile`
        of `row_tile` (None: no rule; the set's row bits do not depend on the row count).
    kernel_language: what its kernels are written in, for messages.
    cpu_interpreter_env: on a set without "cpu" in `devices`, the environment variable that, set to "1",
        runs its kernels on a CPU in an interpreter (for tests; None: never on a CPU).
    host_probed: its invariances are probed on the host before a job computes (CPU sets).
    cuda_graphs: the embedded engine's decode may run in CUDA graphs (no host work per step).
    sglang_package: the model package it runs in inside released SGLang (None: stock SGLang).
    own_logprobs: its logprob recipe is not torch's log_softmax (SGLang's sampler must use the set's).
    reads_kv_pool: its attention kernel reads SGLang's KV pool in place (no gather).
    rope_table: cos/sin are built once per model rather than per forward.
    sglang_attention_backend: SGLang's attention backend on CUDA with the model package (None: default).
    trainer_layer_spec: Megatron layer spec that runs it: "kernels" (tonpolicy's) or "stock" (local).
    builder: "module:Class" that builds it, imported only when the set is built.
    params: the construction parameters the builder takes (a subset of BUILD_PARAMS)."""

    name: str
    devices: tuple[str, ...]
    invariant: bool
    bf16_logits: bool
    fixed_attention_tile: int | None
    row_tile_multiple: int | None
    kernel_language: str
    cpu_interpreter_env: str | None
    host_probed: bool
    cuda_graphs: bool
    sglang_package: str | None
    own_logprobs: bool
    reads_kv_pool: bool
    rope_table: bool
    sglang_attention_backend: str | None
    trainer_layer_spec: str
    builder: str
    params: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = set(self.params) - set(BUILD_PARAMS)
        if unknown:
            raise ValueError(f"kernel set {self.name!r}: params {sorted(unknown)} are not among {BUILD_PARAMS}")
        if self.trainer_layer_spec not in ("kernels", "stock"):
            raise ValueError(
                f"kernel set {self.name!r}: trainer_layer_spec={self.trainer_layer_spec!r} must be 'kernels' or 'stock'"
            )
        if ":" not in self.builder:
            raise ValueError(f"kernel set {self.name!r}: builder={self.builder!r} must be 'module:Class'")

    def build_class(self) -> Any:
        """The class that builds this set (its module imported now, not at registration)."""
        module, _, cls = self.builder.partition(":")
        return getattr(importlib.import_module(module), cls)


_REGISTRY: dict[str, KernelSetSpec] = {}


def register_kernel_set(spec: KernelSetSpec) -> None:
    """Add a kernel set; a name already registered is refused (one set, one spec)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"kernel set {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def kernel_set(name: str) -> KernelSetSpec:
    """The spec of kernel set `name`; an unknown name is an error listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel set {name!r} (known: {', '.join(kernel_set_names())})") from None


def kernel_set_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def kernel_sets() -> tuple[KernelSetSpec, ...]:
    return tuple(_REGISTRY.values())


def quant_sets() -> tuple[str, ...]:
    """The kernel sets that take contract.quant (their params hold "quant")."""
    return tuple(s.name for s in _REGISTRY.values() if "quant" in s.params)


_CONTRACT_PARAMS = tuple(p for p in BUILD_PARAMS if p != "quant")

register_kernel_set(
    KernelSetSpec(
        name="ordered",  # contract v2: every sum an fp32 chain in an order the source owns (CPU)
        devices=("cpu",),
        invariant=True,
        bf16_logits=True,
        fixed_attention_tile=None,
        row_tile_multiple=None,
        kernel_language="C++",
        cpu_interpreter_env=None,
        host_probed=True,
        cuda_graphs=False,
        sglang_package=CONTRACT_SGLANG_PACKAGE,
        own_logprobs=True,
        reads_kv_pool=False,
        rope_table=False,
        sglang_attention_backend=None,
        trainer_layer_spec="kernels",
        builder="tonpolicy.kernels.invariant.ordered_quant:QuantOrderedKernels",
        params=BUILD_PARAMS,  # takes contract.quant=fp8_block (as the triton set does, with its own GEMM)
    )
)
register_kernel_set(
    KernelSetSpec(
        name="invariant",  # contract v1: exact fixed-point GEMMs in fp64, any torch device
        devices=("cpu", "cuda"),
        invariant=True,
        bf16_logits=True,
        fixed_attention_tile=None,
        row_tile_multiple=4,  # GEMMs of 1-3 rows take another library path, other bits
        kernel_language="torch",
        cpu_interpreter_env=None,
        host_probed=True,
        cuda_graphs=False,
        sglang_package=CONTRACT_SGLANG_PACKAGE,
        own_logprobs=False,
        reads_kv_pool=False,
        rope_table=False,
        sglang_attention_backend=None,
        trainer_layer_spec="kernels",
        builder="tonpolicy.kernels.invariant.kernel_set:InvariantKernels",
        params=_CONTRACT_PARAMS,
    )
)
register_kernel_set(
    KernelSetSpec(
        name="triton",  # the same invariances on GPU tensor cores, its own numerics
        devices=("cuda",),
        invariant=True,
        bf16_logits=False,
        fixed_attention_tile=64,
        row_tile_multiple=None,
        kernel_language="Triton",
        cpu_interpreter_env="TRITON_INTERPRET",
        host_probed=False,
        cuda_graphs=True,
        sglang_package=CONTRACT_SGLANG_PACKAGE,
        own_logprobs=True,
        reads_kv_pool=True,
        rope_table=True,
        sglang_attention_backend="triton",
        trainer_layer_spec="kernels",
        builder="tonpolicy.kernels.triton.kernel_set:TritonKernels",
        params=("canonical_shards", "quant"),  # fp8_block: Hopper FP8 MMAs (triton/fp8_linear.py)
    )
)
register_kernel_set(
    KernelSetSpec(
        name="plain",  # plain torch: the negative control
        devices=("cpu", "cuda"),
        invariant=False,
        bf16_logits=False,
        fixed_attention_tile=None,
        row_tile_multiple=None,
        kernel_language="torch",
        cpu_interpreter_env=None,
        host_probed=False,
        cuda_graphs=False,
        sglang_package=None,
        own_logprobs=False,
        reads_kv_pool=False,
        rope_table=False,
        sglang_attention_backend=None,
        trainer_layer_spec="stock",
        builder="tonpolicy.kernels.plain.kernel_set:PlainKernels",
        params=("attention_tile", "canonical_shards"),
    )
)
