"""Build megatron-core's GPTModel for a tonpolicy ModelConfig (Qwen3 dense) at the current layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from tonpolicy.config.model import ModelConfig
from tonpolicy.contract.megatron_args import gpt_model_kwargs, transformer_kwargs

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def transformer_config(
    cfg: ModelConfig, dtype: torch.dtype, pp_layers: tuple[int, ...] | None = None, exact_zero: bool = True
) -> TransformerConfig:
    """The plan's TransformerConfig (tonpolicy.contract.megatron_args) at the current layout."""
    kw = transformer_kwargs(
        cfg,
        DTYPE_NAMES[dtype],
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
        pp_layers,
        exact_zero,
    )
    kw.update(activation_func=F.silu, params_dtype=dtype, pipeline_dtype=dtype)
    # Build-only settings (no numerics): initialise on the CPU (then move once); mark TP-sharded
    # params (grad-norm filters need it).
    return TransformerConfig(**kw, use_cpu_initialization=True, perform_initialization=True)


def build_gpt(
    cfg: ModelConfig,
    dtype: torch.dtype,
    spec: str,
    cp_mode: str,
    kernels: Any,
    canonical_shards: int,
    pp_layers: tuple[int, ...] | None = None,
    exact_zero: bool = True,
) -> GPTModel:
    """`spec`: 'kernels' (layer spec on the kernel set `kernels`) or 'stock' (megatron's local spec:
    the off-policy negative control). `canonical_shards` is the contract's: it fixes the padded vocab."""
    config = transformer_config(cfg, dtype, pp_layers, exact_zero)
    common = dict(
        config=config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **gpt_model_kwargs(cfg, canonical_shards, spec),
    )
    if spec == "kernels":
        from tonpolicy.trainer.layer_spec import install_kernel_head, kernel_block_spec

        # RoPE is applied by the kernel core attention from the microbatch's absolute positions.
        block = kernel_block_spec(config, kernels, cfg.rope_theta, cp_mode)
        model = GPTModel(transformer_layer_spec=block, **common)
        install_kernel_head(model, kernels)
    elif spec == "stock":
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(transformer_layer_spec=layer_spec, **common)
    else:
        raise ValueError(f"unknown layer spec {spec!r}")
    if dtype == torch.bfloat16:
        model = model.to(dtype)
    if torch.cuda.is_available():  # built on CPU (use_cpu_initialization), then moved once
        model = model.cuda()
    return model
