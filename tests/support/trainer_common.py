"""Shared helpers for the trainer tests: random HF Qwen3 weights for the tiny profile, a model's grad norm."""

from __future__ import annotations

import torch

from tonpolicy.config.model import ModelConfig


def random_hf(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + torch.randn(n, generator=g) * 0.1

    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, H), "model.norm.weight": norm(H)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = r(cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
                p + "self_attn.q_proj.weight": r(cfg.q_size, H),
                p + "self_attn.k_proj.weight": r(cfg.kv_size, H),
                p + "self_attn.v_proj.weight": r(cfg.kv_size, H),
                p + "self_attn.o_proj.weight": r(H, cfg.q_size),
                p + "self_attn.q_norm.weight": norm(D),
                p + "self_attn.k_norm.weight": norm(D),
                p + "mlp.gate_proj.weight": r(F, H),
                p + "mlp.up_proj.weight": r(F, H),
                p + "mlp.down_proj.weight": r(H, F),
            }
        )
    return sd


def grads_for_norm(model: torch.nn.Module) -> list[torch.Tensor]:
    """Megatron's optimizer's filter: skip TP replicas (counted on TP rank 0) and shared copies."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    out = []
    for p in model.parameters():
        grad = getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
        if grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            out.append(grad.float())
    return out


def grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of all gradients across TP and PP, each weight counted once, as Megatron's optimizer
    computes it (the trainer takes it from the optimizer; tests without one use this)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    return float(
        get_grad_norm_fp32(grads_for_norm(model), grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    )
