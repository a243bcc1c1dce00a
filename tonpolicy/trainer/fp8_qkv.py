"""The trainer's QKV linear under contract.quant=fp8_block.

Megatron stores the fused QKV weight interleaved per query group ([q heads, k, v] per group); the fp8
weight blocks are 128-row blocks of the Hugging Face q, k and v weights, which the rollout engine fuses as
[q; k; v]. So the kernel runs on this rank's rows reordered to [q; k; v] (each part quantized in its HF
weight's own blocks) and its output columns
are put back in Megatron's order. Each output column's bits depend only on its row and that row's block,
so the reorder changes no bit. At TP > 1 the rank's q, k and v rows are its slices of the HF weights, a
block cut by the split scaled by the whole block's amax (trainer.fp8_gate_up).
Without fp8 it is the plain kernel column-parallel linear."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state

from tonpolicy.kernels import weight_cache
from tonpolicy.trainer.fp8_gate_up import fp8_parts
from tonpolicy.trainer.kernel_autograd import KernelLinear
from tonpolicy.trainer.kernel_modules import KernelColumnParallelLinear, tp_dgrad_group


def hf_order(groups: int, per_group_q: int, head_dim: int) -> torch.Tensor:
    """Row indices that take a Megatron-interleaved QKV weight of `groups` query groups to [q; k; v]."""
    per = (per_group_q + 2) * head_dim
    base = torch.arange(groups)[:, None] * per
    q = (base + torch.arange(per_group_q * head_dim)).reshape(-1)
    k = (base + per_group_q * head_dim + torch.arange(head_dim)).reshape(-1)
    v = (base + (per_group_q + 1) * head_dim + torch.arange(head_dim)).reshape(-1)
    return torch.cat([q, k, v])


class KernelQKVLinear(KernelColumnParallelLinear):
    _reordered: tuple[tuple, torch.Tensor] | None = None

    def _order(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        tp = parallel_state.get_tensor_model_parallel_world_size()
        order = hf_order(c.num_query_groups // tp, c.num_attention_heads // c.num_query_groups, c.kv_channels)
        return order, torch.argsort(order)

    def _hf_rows(self, w: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """w's rows in [q; k; v] order, one tensor per weights version (the fp8 weight cache keys on it)."""
        key = (w._version, w.data_ptr(), weight_cache.generation())
        if self._reordered is None or self._reordered[0] != key:
            self._reordered = (key, w.detach().index_select(0, order))
        return self._reordered[1]

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        if not getattr(self.kernels, "fp8", False):
            return super().forward(input_, weight, runtime_gather_output)
        w = self.weight if weight is None else weight
        order, back = self._order()
        c = self.config
        q, kv = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
        rows, reduce = fp8_parts([q, kv, kv], tp_dgrad_group())

        def fn(x: torch.Tensor, w_: Any) -> torch.Tensor:
            return self.kernels.linear(x, self._hf_rows(w_, order), rows, reduce).index_select(-1, back)

        return KernelLinear.apply(input_, w, fn, tp_dgrad_group()), None
