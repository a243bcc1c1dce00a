"""Build megatron-core's GPTModel for a tonpolicy ModelConfig (Qwen3 dense or MoE) at the current layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from tonpolicy.config.dtypes import dtype_name
from tonpolicy.config.layout import Layout
from tonpolicy.config.model import ModelConfig
from tonpolicy.contract.megatron_args import gpt_model_kwargs, transformer_kwargs
from tonpolicy.families import family, resolve


def transformer_config(
    cfg: ModelConfig,
    dtype: torch.dtype,
    pp_layers: tuple[int, ...] | None = None,
    exact_zero: bool = True,
    moe_capacity_factor: float | None = None,
) -> TransformerConfig:
    """The plan's TransformerConfig (tonpolicy.contract.megatron_args) at the current layout."""
    layout = Layout(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        pp_layers=pp_layers,
        ep=parallel_state.get_expert_model_parallel_world_size(),
    )
    kw = transformer_kwargs(cfg, dtype_name(dtype), layout, exact_zero, moe_capacity_factor)
    kw.update(activation_func=F.silu, params_dtype=dtype, pipeline_dtype=dtype)
    # Build-only settings (no numerics): initialise on the CPU (then move once); mark TP-sharded
    # params (grad-norm filters need it).
    return TransformerConfig(**kw, use_cpu_initialization=True, perform_initialization=True)


def spec_provider(spec: str, kernels: Any, rope_theta: float, cp_type: str) -> Any:
    """'kernels': every op on the kernel set (RoPE applied by the kernel core attention from the
    microbatch's absolute positions); 'stock': megatron's local modules (the off-policy control)."""
    from tonpolicy.trainer.spec_providers import KernelSpecProvider, StockSpecProvider

    if spec == "kernels":
        return KernelSpecProvider(kernels, rope_theta, cp_type)
    if spec == "stock":
        return StockSpecProvider()
    raise ValueError(f"unknown layer spec {spec!r}")


def build_gpt(
    cfg: ModelConfig,
    dtype: torch.dtype,
    spec: str,
    cp_type: str,
    kernels: Any,
    canonical_shards: int,
    pp_layers: tuple[int, ...] | None = None,
    exact_zero: bool = True,
    moe_capacity_factor: float | None = None,
) -> GPTModel:
    """`spec`: 'kernels' (layer spec on the kernel set `kernels`) or 'stock' (megatron's local spec:
    the off-policy negative control). `canonical_shards` is the contract's: it fixes the padded vocab."""
    config = transformer_config(cfg, dtype, pp_layers, exact_zero, moe_capacity_factor)
    common = dict(
        config=config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **gpt_model_kwargs(cfg, canonical_shards, spec),
    )
    provider = spec_provider(spec, kernels, cfg.rope_theta, cp_type)
    # The model family's layer spec (tonpolicy.families), filled from the provider.
    block = resolve(family(cfg.family).layer_spec)(config, provider)
    model = GPTModel(transformer_layer_spec=block, **common)
    provider.install_head(model)
    if dtype == torch.bfloat16:
        model = model.to(dtype)
    if torch.cuda.is_available():  # built on CPU (use_cpu_initialization), then moved once
        model = model.cuda()
    return model
