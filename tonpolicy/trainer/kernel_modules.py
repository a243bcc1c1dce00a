"""The kernel modules of the trainer's dense layers: megatron-core's linears, MLP and norms with every
numerical op routed to a tonpolicy kernel set (the same functions the rollout model calls).

- column-parallel linears: `kernels.linear` on the local weight (its columns equal the unsharded op's);
- row-parallel linears: `kernels.linear_partials` over this rank's canonical K-shards, combined across
  TP in the fixed tree (`kernels.row_parallel`) -> the same bits at TP=1/2/4;
- RMSNorm (incl. QK-norm), SwiGLU, RoPE, core attention: the kernels; context parallel (Ulysses and
  zigzag ring) lives inside the core attention module (megatron's own CP needs TransformerEngine);
- LM head: a contract column-parallel linear over the TP-independent padded vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule

from tonpolicy.kernels.row_parallel import combine_row_parallel
from tonpolicy.trainer import cp_layout, kernel_autograd
from tonpolicy.trainer.cp_attention import batched_attention, context_parallel_attention
from tonpolicy.trainer.kernel_autograd import KernelLinear


class _TakesKernels:
    """The kernel set as a constructor argument (KernelSpecProvider passes it as spec params)."""

    def __init__(self, *args: Any, kernels: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = kernels


def tp_dgrad_group() -> Any:
    """The group a column-parallel linear all-reduces its input gradient over (None at TP=1)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


class KernelColumnParallelLinear(_TakesKernels, ColumnParallelLinear):
    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        return KernelLinear.apply(input_, w, self.kernels.linear, tp_dgrad_group()), None


class KernelRowParallelLinear(_TakesKernels, RowParallelLinear):
    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        shards = self.kernels.canonical_shards
        if shards % tp:
            raise ValueError(f"TP={tp} must divide the contract's {shards} canonical shards")
        group = parallel_state.get_tensor_model_parallel_group()

        def canonical(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # This rank's canonical K-shard partials, combined across TP in the contract's fixed tree.
            return combine_row_parallel(self.kernels, self.kernels.linear_partials(x, w, shards // tp), x.dtype, group)

        # Every TP rank holds the same y and receives the same dY, so the local gradients need no
        # communication (dX_local = dY W_local, dW_local = dY^T X_local): the plain linear backward.
        return KernelLinear.apply(input_, self.weight, canonical), None


class KernelLMHead(KernelColumnParallelLinear):
    """Column-parallel LM head: the kernel set's own `lm_head` (fp32 logits, never rounded to the
    activation dtype), the call the rollout model makes, on this rank's vocab rows.

    `rows` (set by `lm_head_rows` for one forward): flat indices into the [s*b] hidden rows whose
    logits are read; only those go through the head (a contract kernel's row bits do not depend on
    the row count), the others are zero. Prompt rows then cost nothing in the head, forward or backward."""

    rows: torch.Tensor | None = None

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        group = tp_dgrad_group()
        if self.rows is None:
            return KernelLinear.apply(input_, w, self.kernels.lm_head, group), None
        flat = input_.reshape(-1, input_.shape[-1])
        picked = KernelLinear.apply(flat.index_select(0, self.rows), w, self.kernels.lm_head, group)
        out = picked.new_zeros(flat.shape[0], picked.shape[-1]).index_copy(0, self.rows, picked)
        return out.view(*input_.shape[:-1], -1), None


@contextlib.contextmanager
def lm_head_rows(model: torch.nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's kernel LM head (if this stage has one) computes only `rows`
    (flat indices into its [s*b] input rows); every other row's logits are zero."""
    heads = [m for m in model.modules() if isinstance(m, KernelLMHead)]
    for h in heads:
        h.rows = rows
    try:
        yield
    finally:
        for h in heads:
            h.rows = None


class KernelRMSNorm(MegatronModule):
    """RMSNorm with the kernel's formula; `weight` is named as in megatron's local spec."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, kernels: Any = None, **_: Any
    ) -> None:
        super().__init__(config=config)
        self.kernels, self.eps = kernels, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_autograd.KernelRMSNorm.apply(x, self.weight, self.eps, self.kernels.rms_norm)


class KernelMLP(_TakesKernels, MLP):
    """Fused gate/up column-parallel linear -> kernel SwiGLU -> row-parallel linear."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        inter, _b = self.linear_fc1(hidden_states)
        gate, up = inter.chunk(2, dim=-1)
        out, _b = self.linear_fc2(kernel_autograd.KernelSwiGLU.apply(gate, up, self.kernels.swiglu))
        return out, None


class KernelCoreAttention(MegatronModule):
    """RoPE (from the microbatch's absolute positions) + split-KV causal attention, with CP inside."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        kernels: Any = None,
        rope_theta: float = 1e6,
        cp_type: str = "ulysses",
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        self.kernels, self.theta, self.cp_type = kernels, rope_theta, cp_type
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if not isinstance(packed_seq_params, cp_layout.TokenPositions):
            raise ValueError("the contract attention needs the microbatch's TokenPositions as packed_seq_params")
        positions = packed_seq_params.positions  # [b, s_local]
        k_ = self.kernels
        if parallel_state.get_context_parallel_world_size() == 1 and all(
            cp_layout.segment_starts(p) == [0] for p in positions
        ):
            return self._whole_rows(query, key, value, positions)
        outs = []
        for b in range(query.shape[1]):
            pos = positions[b]
            cos, sin = k_.rope_cos_sin(pos, self.head_dim, self.theta)
            q, k = k_.apply_rope_qk(query[:, b], key[:, b], cos, sin)
            # A packed row holds several samples, each restarting at position 0: attend within each.
            bounds = [*cp_layout.segment_starts(pos), pos.numel()]
            outs.append(
                torch.cat(
                    [
                        context_parallel_attention(
                            k_, q[s:e], k[s:e], value[s:e, b], pos[s:e], self.scale, self.cp_type
                        )
                        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
                    ]
                )
            )
        out = torch.stack(outs, dim=1)  # [s, b, h, d]
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _whole_rows(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Every row one sequence, no CP: RoPE and attention for all rows in one call each (the kernels
        are row- and batch-invariant, so these are the per-row bits, at a fraction of the calls)."""
        s, b, hq, d = query.shape
        k_ = self.kernels
        cos, sin = k_.rope_cos_sin(positions.reshape(-1), self.head_dim, self.theta)
        q, k = k_.apply_rope_qk(
            query.transpose(0, 1).reshape(b * s, hq, d), key.transpose(0, 1).reshape(b * s, -1, d), cos, sin
        )
        out = batched_attention(
            k_, q.view(b, s, hq, d), k.view(b, s, -1, d), value.transpose(0, 1), positions, self.scale
        )
        return out.transpose(0, 1).reshape(s, b, hq * d)
