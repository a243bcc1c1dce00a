"""The spec providers the trainer's layers are filled from (megatron-core's BackendSpecProvider):
`KernelSpecProvider` for the contract (every module a kernel module on one kernel set),
`StockSpecProvider` (megatron's own local modules) for the off-policy control.

Megatron's protocol types its slots as returning a module class; the kernel provider returns ModuleSpecs
(a class plus the kernel set as constructor params), which megatron's layer builders accept as well,
hence the `type: ignore[override]` on those slots.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import ModuleSpec, transformer_block
from megatron.core.transformer.mlp import MLP, MLPSubmodules

from tonpolicy.trainer.fp8_gate_up import KernelGateUpLinear
from tonpolicy.trainer.fp8_qkv import KernelQKVLinear
from tonpolicy.trainer.kernel_modules import (
    KernelColumnParallelLinear,
    KernelCoreAttention,
    KernelLMHead,
    KernelMLP,
    KernelRMSNorm,
    KernelRowParallelLinear,
)
from tonpolicy.trainer.moe_layer import kernel_moe_spec, stock_moe_spec


class StockSpecProvider(LocalSpecProvider):
    """Megatron's own local modules (the off-policy control), plus the slots megatron's
    BackendSpecProvider protocol lacks: the dense MLP module, the final norm and the LM head."""

    def dense_mlp(self) -> ModuleSpec:
        return ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=self.column_parallel_linear(), linear_fc2=self.row_parallel_linear()),
        )

    def qkv_linear(self) -> Any:
        """The attention's fused QKV linear (a column-parallel linear)."""
        return self.column_parallel_linear()

    def moe_mlp(self) -> ModuleSpec:
        """megatron's MoELayer: TopKRouter, the all-gather dispatcher, SequentialMLP (trainer.moe_layer)."""
        return stock_moe_spec(self)

    def final_norm(self) -> type:
        return transformer_block.LayerNormImpl  # what megatron's block picks for a layer spec

    def install_head(self, model: GPTModel) -> None:
        """Megatron's own head: nothing to do."""


class KernelSpecProvider(StockSpecProvider):
    """Every numerical op on one kernel set, the calls the rollout model makes. A kernel set reaches a
    module one way only: the ModuleSpec's `params={"kernels": ...}` (Megatron passes spec params to the
    constructor)."""

    def __init__(self, kernels: Any, rope_theta: float, cp_type: str) -> None:
        self.kernels, self.rope_theta, self.cp_type = kernels, rope_theta, cp_type

    def _spec(self, module: type, **params: Any) -> ModuleSpec:
        return ModuleSpec(module=module, params={"kernels": self.kernels, **params})

    def column_parallel_linear(self) -> ModuleSpec:  # type: ignore[override]
        return self._spec(KernelColumnParallelLinear)

    def row_parallel_linear(self) -> ModuleSpec:  # type: ignore[override]
        return self._spec(KernelRowParallelLinear)

    def qkv_linear(self) -> ModuleSpec:
        return self._spec(KernelQKVLinear)

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> ModuleSpec:  # type: ignore[override]
        if not rms_norm:
            raise ValueError("the contract kernels have RMSNorm only")
        return self._spec(KernelRMSNorm)

    def core_attention(self) -> ModuleSpec:  # type: ignore[override]
        return self._spec(KernelCoreAttention, rope_theta=self.rope_theta, cp_type=self.cp_type)

    def dense_mlp(self) -> ModuleSpec:
        fc1_fc2 = MLPSubmodules(linear_fc1=self._spec(KernelGateUpLinear), linear_fc2=self.row_parallel_linear())
        return ModuleSpec(module=KernelMLP, params={"kernels": self.kernels}, submodules=fc1_fc2)

    def moe_mlp(self) -> ModuleSpec:
        """The contract's MoE layer on the kernel set, EP by tonpolicy's own exchange (trainer.moe_layer)."""
        return kernel_moe_spec(self.kernels)

    def final_norm(self) -> ModuleSpec:  # type: ignore[override]
        return self.layer_norm(rms_norm=True)

    def install_head(self, model: GPTModel) -> None:
        """GPTModel builds its LM head itself, a ColumnParallelLinear with no spec slot to pass (its
        constructor takes no head class): give that module the kernel head's forward (its parameters,
        names and tied-weight wiring untouched) and the kernel set, as every other module gets it.
        Building a second head and swapping it in would re-do the tied-embedding wiring megatron owns."""
        head = getattr(model, "output_layer", None)
        if head is not None:
            head.__class__ = KernelLMHead
            head.kernels = self.kernels
