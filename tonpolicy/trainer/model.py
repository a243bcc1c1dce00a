"""Build megatron-core's GPTModel for a tonpolicy ModelConfig (Qwen3 dense) at the current layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from tonpolicy.config.model import ModelConfig, pipeline_stage_layers
from tonpolicy.kernels import get_kernels, padded_vocab_size

# Canonical K-shard count of the contract's row-parallel reduction; any TP dividing it is exact.
CANONICAL_SHARDS = 4


def padded_vocab(cfg: ModelConfig, canonical_shards: int = CANONICAL_SHARDS) -> int:
    """TP-independent padded vocab, so every layout (and the rollout) sees the same logits width."""
    return padded_vocab_size(cfg.vocab_size, canonical_shards)


def transformer_config(cfg: ModelConfig, dtype: torch.dtype, pp_layers: tuple[int, ...] | None = None) -> TransformerConfig:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    stages = pipeline_stage_layers(cfg.num_layers, pp, pp_layers)
    uneven = pp > 1 and len(set(stages)) > 1
    return TransformerConfig(
        # Uneven stages the Megatron way: first and last stage sizes, the rest split evenly.
        num_layers_in_first_pipeline_stage=stages[0] if uneven else None,
        num_layers_in_last_pipeline_stage=stages[-1] if uneven else None,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=True,  # also marks TP-sharded params (needed by grad-norm filters)
        init_method_std=cfg.init_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=False,
    )


def build_gpt(cfg: ModelConfig, dtype: torch.dtype, spec: str = "contract", cp_mode: str = "ulysses",
              kernels: Any = None, canonical_shards: int = CANONICAL_SHARDS,
              pp_layers: tuple[int, ...] | None = None) -> GPTModel:
    """`spec`: 'contract' (layer spec on a tonpolicy kernel set, by default `contract`) or 'stock'
    (megatron's local spec: the off-policy negative control)."""
    config = transformer_config(cfg, dtype, pp_layers)
    pre = parallel_state.is_pipeline_first_stage()
    post = parallel_state.is_pipeline_last_stage()
    common = dict(
        config=config,
        vocab_size=padded_vocab(cfg, canonical_shards),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
    )
    if spec == "contract":
        from tonpolicy.trainer.layer_spec import contract_block_spec, install_contract_head

        kernels = kernels if kernels is not None else get_kernels("contract")
        # RoPE is applied by the contract core attention from the microbatch's absolute positions.
        block = contract_block_spec(config, kernels, cfg.rope_theta, cp_mode)
        model = GPTModel(transformer_layer_spec=block, position_embedding_type="none", **common)
        install_contract_head(model, kernels)
    elif spec == "stock":
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(transformer_layer_spec=layer_spec, position_embedding_type="rope",
                         rotary_base=int(cfg.rope_theta), **common)
    else:
        raise ValueError(f"unknown layer spec {spec!r}")
    if dtype == torch.bfloat16:
        model = model.to(dtype)
    if torch.cuda.is_available():  # built on CPU (use_cpu_initialization), then moved once
        model = model.cuda()
    return model
