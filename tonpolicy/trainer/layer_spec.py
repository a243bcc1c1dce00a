"""The block specs: megatron-core's TransformerLayer/SelfAttention/MLP skeleton of a Qwen3 (dense or MoE)
stage, every module taken from a spec provider (tonpolicy.trainer.spec_providers), whose kernel modules
(tonpolicy.trainer.kernel_modules, trainer.moe_layer) route each numerical op to a tonpolicy kernel set.
The contract spec and the stock spec differ only by the provider.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from tonpolicy.trainer.spec_providers import StockSpecProvider


def dense_layer_spec(provider: StockSpecProvider) -> ModuleSpec:
    """A Qwen3 dense layer (pre-norm, QK-norm, SwiGLU MLP) as megatron's local GPT spec lays it out,
    every module taken from `provider`: the contract spec and the stock spec differ only by it."""
    return layer_spec(provider, provider.dense_mlp())


def layer_spec(provider: StockSpecProvider, mlp: ModuleSpec) -> ModuleSpec:
    """A Qwen3 layer with the MLP `mlp` (the dense MLP, or a MoE layer), the rest from `provider`."""
    norm, qk_norm = provider.layer_norm(rms_norm=True), provider.layer_norm(rms_norm=True, for_qk=True)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=provider.qkv_linear(),
                    core_attention=provider.core_attention(),
                    linear_proj=provider.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def dense_block_spec(config: TransformerConfig, provider: StockSpecProvider) -> TransformerBlockSubmodules:
    """This pipeline stage's layers plus the final norm (tonpolicy.families' `layer_spec` for qwen3)."""
    return TransformerBlockSubmodules(
        layer_specs=[dense_layer_spec(provider)] * get_num_layers_to_build(config),
        layer_norm=provider.final_norm(),
    )


def moe_block_spec(config: TransformerConfig, provider: StockSpecProvider) -> TransformerBlockSubmodules:
    """This pipeline stage's Qwen3-MoE layers (tonpolicy.families' `layer_spec` for qwen3_moe): the MoE
    MLP where `config.moe_layer_freq` routes (megatron_args: mlp_only_layers, decoder_sparse_step), the
    dense MLP elsewhere, plus the final norm."""
    first = get_transformer_layer_offset(config)
    routed = config.moe_layer_freq
    specs = [
        layer_spec(provider, provider.moe_mlp() if routed[first + i] else provider.dense_mlp())
        for i in range(get_num_layers_to_build(config))
    ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=provider.final_norm())
