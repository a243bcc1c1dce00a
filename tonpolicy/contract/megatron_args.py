"""The Megatron configuration a run implies, built once: the launch plan renders it, the trainer
builds its TransformerConfig and GPTModel from it (tests/contract/test_megatron_args.py compares the built
model with the plan). Plain data (JSON-able): the trainer maps names to objects (`silu` -> F.silu,
dtype names -> torch dtypes) and adds build-only settings that change no numerics."""

from __future__ import annotations

from typing import Any

from tonpolicy.config.layout import Layout
from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import padded_vocab_size
from tonpolicy.kernels.sets import kernel_set


def transformer_kwargs(
    model: ModelConfig, dtype: str, layout: Layout, exact_zero: bool, moe_capacity_factor: float | None = None
) -> dict[str, Any]:
    """TransformerConfig arguments (numerics and the layout's sizes)."""
    stages = layout.stage_layers(model.num_layers)
    uneven = layout.pp > 1 and len(set(stages)) > 1
    return {
        **_moe_kwargs(model, moe_capacity_factor),
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_kv_heads,
        "kv_channels": model.head_dim,
        "ffn_hidden_size": model.intermediate_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": model.rms_norm_eps,
        "qk_layernorm": True,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "bf16": dtype == "bfloat16",
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        # Fusions reorder floating-point work; the contract computes these ops in its own kernels.
        "sequence_parallel": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "cross_entropy_loss_fusion": False,
        # Deterministic embedding backward (index, not F.embedding); forward values are the same.
        "deterministic_mode": exact_zero,
        "init_method_std": model.init_std,
        **layout.megatron_sizes,
        # Uneven stages the Megatron way: first and last stage sizes, the rest split evenly.
        "num_layers_in_first_pipeline_stage": stages[0] if uneven else None,
        "num_layers_in_last_pipeline_stage": stages[-1] if uneven else None,
    }


def _moe_kwargs(model: ModelConfig, capacity_factor: float | None) -> dict[str, Any]:
    """Megatron's MoE settings for a Qwen3-MoE profile (none for a dense one). The contract layer spec
    routes with the kernel set and exchanges tokens itself; the stock spec runs Megatron's router and
    the all-gather dispatcher (the all-to-all one passes its split sizes as tensors, which gloo refuses)."""
    if not model.is_moe:
        return {}
    coef = model.router_aux_loss_coef
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.num_experts_per_tok,
        "moe_ffn_hidden_size": model.moe_intermediate_size,
        "moe_layer_freq": [int(model.is_moe_layer(i)) for i in range(model.num_layers)],
        # Qwen3-MoE's norm_topk_prob: softmax over the k chosen logits; else softmax over all, then top-k.
        "moe_router_pre_softmax": not model.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if coef > 0 else "none",
        "moe_aux_loss_coeff": coef,
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_expert_capacity_factor": capacity_factor,
    }


def gpt_model_kwargs(model: ModelConfig, canonical_shards: int, spec: str) -> dict[str, Any]:
    """GPTModel arguments. The kernel spec applies RoPE inside its core attention (from absolute
    positions, CP-aware), so Megatron's own rotary embedding is off there."""
    kernel_spec = spec == "kernels"
    out: dict[str, Any] = {
        "vocab_size": padded_vocab_size(model.vocab_size, canonical_shards),
        "max_sequence_length": model.max_position_embeddings,
        "position_embedding_type": "none" if kernel_spec else "rope",
        "share_embeddings_and_output_weights": model.tie_word_embeddings,
        "parallel_output": True,
    }
    if not kernel_spec:
        out["rotary_base"] = int(model.rope_theta)
    return out


def layer_spec(kernels: str) -> str:
    """'kernels' (tonpolicy's layer spec on the kernel set) or 'stock' (megatron's local spec)."""
    return kernel_set(kernels).trainer_layer_spec
