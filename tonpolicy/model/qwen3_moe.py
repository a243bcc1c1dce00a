"""Qwen3-MoE on top of a kernel set: Qwen3's attention, and in every routed layer a router
(`mlp.gate`) and `num_experts` SwiGLU experts (`mlp.experts.{e}`), HF names throughout.

No parallelism here. A token's routes, weights and output come from the kernel set's MoE ops
(tonpolicy/kernels/moe.py): each expert's GEMMs see only the rows routed to it, so the kernels' row
invariance is what keeps a token's bits from depending on which other tokens chose that expert. Layers
in `mlp_only_layers` (or off the `decoder_sparse_step`) keep the dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from tonpolicy.kernels.moe import Routing
from tonpolicy.model.qwen3 import Qwen3, Weight


class Qwen3Moe(Qwen3):
    # When set, each forward leaves its routing per MoE layer here ({layer: Routing}: [N, k] expert ids in
    # ascending order, their fp32 weights) for the rows it computed (the routed-experts report, tests).
    routes: dict[int, Routing] | None = None

    def _build_mlp(self, layer: int) -> nn.Module:
        cfg, dtype = self.cfg, self.dtype
        if not cfg.is_moe_layer(layer):
            return super()._build_mlp(layer)
        h, f = cfg.hidden_size, cfg.moe_intermediate_size
        mlp = nn.Module()
        mlp.gate = Weight((cfg.num_experts, h), dtype)
        mlp.experts = nn.ModuleList()
        for _ in range(cfg.num_experts):
            e = nn.Module()
            e.gate_proj, e.up_proj, e.down_proj = Weight((f, h), dtype), Weight((f, h), dtype), Weight((h, f), dtype)
            mlp.experts.append(e)
        return mlp

    def _mlp(self, li: int, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.cfg.is_moe_layer(li):
            return super()._mlp(li, mlp, x)
        kern, cfg, f = self.kernels, self.cfg, self.cfg.moe_intermediate_size
        r = kern.route(kern.router_logits(x, mlp.gate.weight), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if self.routes is not None:
            self.routes[li] = r
        outputs = torch.empty((*r.experts.shape, x.shape[-1]), dtype=torch.float32, device=x.device)
        for e in torch.unique(r.experts).tolist():
            rows, slots = torch.nonzero(r.experts == e, as_tuple=True)
            ex = mlp.experts[e]
            gate_up = [ex.gate_proj.weight, ex.up_proj.weight]
            gate, up = self.fused_linear(x.index_select(0, rows), f"{li}.{e}.gate_up", gate_up).split([f, f], dim=-1)
            # Left in fp32 (the K-shard partials summed, not rounded): the combine rounds once.
            partials = kern.linear_partials(kern.swiglu(gate, up), ex.down_proj.weight, kern.canonical_shards)
            outputs[rows, slots] = kern.combine_partials(partials, torch.float32)
        return kern.moe_combine(outputs, r.weights, x.dtype)
