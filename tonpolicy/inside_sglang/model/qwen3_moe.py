"""Qwen3-MoE for released SGLang, every numerical op a contract kernel call.

Attention, norms, embeddings, LM head and the dense layers (`mlp_only_layers`) are the dense
package model's (`qwen3.py`); a routed layer computes exactly `tonpolicy.model.qwen3_moe.Qwen3Moe._mlp`
(the definition of the bits), sharded over SGLang's TP group as the trainer shards it
(`trainer/moe_layer.py`):
- the router is replicated, and tokens are replicated over TP, so every rank routes every token to the
  same experts (fp32 logits, the stable top-k);
- each expert's gate/up are column shards (`kernels.linear` gives those columns of the full result);
- each expert's down is row-parallel: this rank's canonical K-shard partials, combined across ranks in
  the contract's fixed tree and left in fp32 (`combine_row_parallel`). All experts' rows go through one
  combine per layer: the combine is elementwise over rows, so stacking them changes no bit;
- `kernels.moe_combine` of the k fp32 outputs on every rank, one rounding.
With SGLang's `--ep-size` (EP within its TP group: moe_tp = tp / ep), each EP rank holds its consecutive
block of experts, sharded as above over its moe-TP group; the fp32 outputs of every (token, slot) are
then gathered over the EP group and each taken from the one rank that owns its expert (a selection,
no arithmetic), so every EP size gives the same bits.
With `--enable-return-routed-experts`, the routes feed SGLang's own routed-experts capturer as its MoE
layers do: per layer [tokens, top_k] int32 in ascending expert id, -1 in the dense layers.
"""

from __future__ import annotations

import torch
from sglang.srt.distributed.parallel_state import get_moe_ep_group, get_moe_tp_group
from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

from tonpolicy.config import hf_qwen3_moe
from tonpolicy.config.hf_qwen3 import SHARD_DIM
from tonpolicy.inside_sglang.model.fp8_rows import fused_column_linear
from tonpolicy.inside_sglang.model.qwen3 import Qwen3ForCausalLM, _empty, _Layer
from tonpolicy.kernels.row_parallel import combine_row_parallel, gather_in_rank_order


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    adapter = hf_qwen3_moe

    def _build_mlp(self, li: int, layer: _Layer) -> None:
        cfg = self.cfg
        ep, moe_tp = get_moe_ep_group(), get_moe_tp_group()
        self.ep_size, self.ep_rank, self.ep_group = ep.world_size, ep.rank_in_group, ep.device_group
        self.moe_tp_size, self.moe_tp_rank, self.moe_tp_group = (
            moe_tp.world_size,
            moe_tp.rank_in_group,
            moe_tp.device_group,
        )
        if cfg.num_experts % self.ep_size:
            raise ValueError(f"--ep-size {self.ep_size} must divide num_experts={cfg.num_experts}")
        self.local_experts = cfg.num_experts // self.ep_size
        self.moe_inter = f = cfg.moe_intermediate_size // self.moe_tp_size
        if not cfg.is_moe_layer(li):
            super()._build_mlp(li, layer)
            return
        h, e = cfg.hidden_size, self.local_experts
        layer.router = _empty(cfg.num_experts, h)
        layer.experts_gate_up, layer.experts_down = _empty(e, 2 * f, h), _empty(e, h, f)
        layer.expert_views = None

    @staticmethod
    def _expert_weights(layer: _Layer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each local expert's [gate; up] and down: views of the stacked weights, made once per storage.
        A quantizing kernel set caches a weight per tensor object, so a fresh view each forward would
        quantize every routed expert again; views share the stack's version counter, so a weight sync
        (a `copy_` into the stack) still invalidates them."""
        key = (layer.experts_gate_up.data_ptr(), layer.experts_down.data_ptr())
        if layer.expert_views is None or layer.expert_views[0] != key:
            layer.expert_views = (key, list(layer.experts_gate_up.unbind(0)), list(layer.experts_down.unbind(0)))
        return layer.expert_views[1], layer.expert_views[2]

    def _mlp(self, li: int, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        cfg, kern = self.cfg, self.kernels
        capturer = get_global_experts_capturer()
        if not cfg.is_moe_layer(li):
            if capturer is not None:
                capturer.capture(
                    li, torch.full((x.shape[0], cfg.num_experts_per_tok), -1, dtype=torch.int32, device=x.device)
                )
            return super()._mlp(li, layer, x)
        r = kern.route(kern.router_logits(x, layer.router), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        if capturer is not None:
            capturer.capture(li, r.experts.to(torch.int32))
        f, shards = self.moe_inter, kern.canonical_shards // self.moe_tp_size
        # Each expert's [gate; up] rows on this rank: its moe-TP slice of the two HF weights (fp8_block).
        full, at = cfg.moe_intermediate_size, self.moe_tp_rank * f
        parts, group = ((f, at, full), (f, at, full)), self.moe_tp_group if self.moe_tp_size > 1 else None
        first = self.ep_rank * self.local_experts
        gate_ups, downs = self._expert_weights(layer)
        picks, partials = [], []
        # Every rank sees the same tokens and routes, so a moe-TP group's ranks meet the same experts
        # in the same order: the collective below lines up across them.
        for e in torch.unique(r.experts).tolist():
            if not first <= e < first + self.local_experts:
                continue
            rows, slots = torch.nonzero(r.experts == e, as_tuple=True)
            gate_up = fused_column_linear(kern, x.index_select(0, rows), gate_ups[e - first], parts, group)
            gate, up = gate_up.split([f, f], dim=-1)
            partials.append(kern.linear_partials(kern.swiglu(gate, up), downs[e - first], shards))
            picks.append((rows, slots))
        outputs = torch.zeros((*r.experts.shape, x.shape[-1]), dtype=torch.float32, device=x.device)
        if partials:
            group = self.moe_tp_group if self.moe_tp_size > 1 else None
            combined = combine_row_parallel(kern, torch.cat(partials, dim=1), torch.float32, group)
            start = 0
            for rows, slots in picks:
                outputs[rows, slots] = combined[start : start + rows.numel()]
                start += rows.numel()
        if self.ep_size > 1:
            owner = (r.experts // self.local_experts).long()[None, :, :, None]
            outputs = torch.take_along_dim(gather_in_rank_order(outputs[None], self.ep_group), owner, dim=0)[0]
        return kern.moe_combine(outputs, r.weights, x.dtype)

    def _load_layer(self, li: int, suffix: str, w: torch.Tensor) -> None:
        layer = self.layers[li]
        if suffix == hf_qwen3_moe.ROUTER:
            layer.router.copy_(w)  # replicated: every rank routes every token
            return
        expert = hf_qwen3_moe.parse_expert(suffix)
        if expert is None:
            super()._load_layer(li, suffix, w)
            return
        e, proj = expert
        e -= self.ep_rank * self.local_experts
        if not 0 <= e < self.local_experts:
            return  # another EP rank's expert
        f, first = self.moe_inter, self.moe_tp_rank * self.moe_inter
        shard = w.narrow(SHARD_DIM[hf_qwen3_moe.EXPERT_PROJS[proj]], first, f)
        if proj == "down_proj":
            layer.experts_down[e].copy_(shard)
        else:
            rows = slice(0, f) if proj == "gate_proj" else slice(f, 2 * f)
            layer.experts_gate_up[e][rows].copy_(shard)


EntryClass = [Qwen3MoeForCausalLM]
