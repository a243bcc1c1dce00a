"""Qwen3-MoE layers for megatron-core: its `MoELayer` / `TopKRouter` / `SequentialMLP` skeleton, filled
from a spec provider (tonpolicy.trainer.spec_providers), as the dense layers are.

The contract (`KernelMoELayer`) computes what the rollout model's `Qwen3Moe._mlp` computes, the same
kernel calls (tonpolicy/kernels/moe.py): router logits in fp32 by `kernels.router_logits`, routes by
`kernels.route`, each expert a kernel column-parallel fc1 ([gate; up], K whole) -> kernel SwiGLU ->
kernel row-parallel fc2 whose canonical K-shard partials are combined over the expert-TP group and left
in fp32, and `kernels.moe_combine` of the k outputs on the token's own rank. Megatron's dispatchers and
its unpermute/scatter-add combine are not used (they round per expert and sum in another order); the
tokens travel over the EP group by `ep_exchange` (exact by construction).

The control (`StockMoELayer`) is megatron's own router, all-gather dispatcher and SequentialMLP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from tonpolicy.kernels.moe import Routing
from tonpolicy.kernels.row_parallel import combine_row_parallel
from tonpolicy.trainer import ep_exchange
from tonpolicy.trainer.fp8_gate_up import KernelGateUpLinear
from tonpolicy.trainer.kernel_autograd import KernelLinear
from tonpolicy.trainer.kernel_modules import (
    KernelMLP,
    KernelRowParallelLinear,
    _TakesKernels,
)

if TYPE_CHECKING:
    from tonpolicy.trainer.spec_providers import StockSpecProvider


def _own_group(module: Any) -> Any:
    """The linear's own TP group (an expert's is the expert-TP group), None when it has one rank."""
    group = module.tp_group
    return group if group is not None and group.size() > 1 else None


class KernelExpertColumnParallelLinear(KernelGateUpLinear):
    """An expert's fc1 ([gate; up]): its input gradient summed, and its split fp8 blocks reduced, over the
    expert-TP group."""

    def _group(self) -> Any:
        return _own_group(self)


class KernelExpertRowParallelLinear(KernelRowParallelLinear):
    """An expert's fc2: canonical K-shard partials combined over the expert-TP group, left in fp32 (the
    combine of the k outputs rounds once)."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = _own_group(self)
        tp = group.size() if group is not None else 1
        shards = self.kernels.canonical_shards
        if shards % tp:
            raise ValueError(f"expert TP={tp} must divide the contract's {shards} canonical shards")

        def canonical(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            partials = self.kernels.linear_partials(x, w, shards // tp)
            return combine_row_parallel(self.kernels, partials, torch.float32, group)

        return KernelLinear.apply(input_, self.weight, canonical), None


def _report(router: Any, experts: torch.Tensor) -> None:
    """Hand this forward's routes [N, k] (experts ascending) to the recorder, if one listens
    (tonpolicy.trainer.routes.RouteRecorder: the gate's routing_agreement)."""
    if router.route_sink is not None:
        router.route_sink(experts.detach().sort(dim=1).values)


class _AuxLossShare:
    """A router whose load-balancing losses count `aux_share` of their coefficient. megatron weighs each
    microbatch's aux loss 1/num_microbatches, right only when every DP replica runs as many real
    microbatches; with uneven shares (and EP's filler microbatches) the step hook
    `routes.aux_loss_shares` sets each forward's share so the step's aux gradient is the mean over its
    real microbatches, as at tp1 (a filler: 0)."""

    aux_share: float = 1.0

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        return super().get_aux_loss_coeff(aux_loss_type) * self.aux_share  # type: ignore[misc]


class KernelRouter(_AuxLossShare, _TakesKernels, TopKRouter):
    """Megatron's TopKRouter (its weight, its aux losses) routing with the kernel set."""

    route_sink: Any = None  # set by RouteRecorder while it records

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, **kw: Any) -> None:
        super().__init__(config=config, pg_collection=pg_collection, **kw)
        # The aux losses count tokens over TP x CP, right under sequence parallelism; here every TP rank
        # holds the same tokens, so counting them over TP would shrink each rank's loss TP-fold (its
        # gradient too: the router is replicated, its TP gradients are not summed). Count over CP alone.
        self.tp_cp_group = self.cp_group

    def route_tokens(self, x: torch.Tensor, seq_length: int, bsz: int) -> Routing:
        logits = KernelLinear.apply(x, self.weight, self.kernels.router_logits)  # fp32 [N, E]
        # megatron's pre-softmax (softmax over all, then top-k) is Qwen3-MoE's norm_topk_prob=False
        r = self.kernels.route(logits, self.topk, not self.config.moe_router_pre_softmax)
        weights = r.weights
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            # megatron's load-balancing losses, attached to the weights (their forward values untouched)
            rmap, scores = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function, fused=False)
            weights = self._apply_aux_loss(weights, scores, rmap)
            weights = self._apply_seq_aux_loss(weights, scores, rmap, seq_length, bsz)
            weights = self._apply_global_aux_loss(weights, scores, rmap)
        _report(self, r.experts)
        return Routing(r.experts, weights, logits)


class StockRouter(_AuxLossShare, TopKRouter):
    """megatron's TopKRouter, plus two things the control needs: it reports its routes (the gate's
    routing_agreement), and it can route by given experts instead of its own top-k (router replay:
    `trainer.router_replay`), through megatron's own `RouterReplay` hook in its top-k (the weights are
    the softmax of the router's logits at the given experts, with their gradient)."""

    route_sink: Any = None  # set by RouteRecorder while it records

    def replay(self, experts: torch.Tensor | None) -> None:
        """Route the next forwards by `experts` [N, k] (int64, megatron's flat token order), or by the
        router's own top-k again (None)."""
        if experts is None:
            self.router_replay = None
            return
        if self.router_replay is None:
            self.router_replay = RouterReplay()
            # megatron keeps every instance in one class-level list for its global setters; each router
            # here is driven on its own, and a list spanning every model built in the process would leak
            RouterReplay.global_router_replay_instances.remove(self.router_replay)
        self.router_replay.clear_indices()
        self.router_replay.set_target_indices(experts)
        self.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
        probs, routing_map = super().routing(logits, padding_mask)
        if self.route_sink is not None:
            # routing_map [N, E] -> the routed experts ascending; -1 fills a row short of k (a dropped slot)
            e = routing_map.shape[-1]
            ids = torch.arange(e, device=routing_map.device).expand_as(routing_map)
            experts = torch.where(routing_map, ids, e).sort(dim=1).values[:, : self.topk]
            _report(self, torch.where(experts == e, -1, experts))
        return probs, routing_map


class KernelExperts(_TakesKernels, SequentialMLP):
    """This EP rank's experts (megatron's SequentialMLP), each a `KernelMLP` on the expert linears."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: Any, **kw: Any) -> None:
        super().__init__(num_local_experts, config, submodules, **kw)
        first = self.ep_group.rank() * num_local_experts
        self.local_expert_ids = list(range(first, first + num_local_experts))
        for expert in self.local_experts:  # megatron's SequentialMLP builds plain MLPs: give them the kernels
            expert.__class__ = KernelMLP
            expert.kernels = self.kernels

    def compute(self, tokens: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[T, k, H] fp32: each (token, slot) routed to a local expert, -0.0 in the others."""
        out = ep_exchange.empty_outputs(experts, tokens.shape[-1], tokens.device)
        for local, e in enumerate(self.local_expert_ids):
            rows, slots = torch.nonzero(experts == e, as_tuple=True)
            if rows.numel():
                y, _ = self.local_experts[local](tokens.index_select(0, rows))
                out.index_put_((rows, slots), y)
        return out


class KernelMoELayer(_TakesKernels, MoELayer):
    """route (kernel router) -> EP exchange + local experts -> `kernels.moe_combine` on the own rank."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None, padding_mask: Any = None) -> Any:
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)
        r = self.router.route_tokens(x, s, b)
        group = self.ep_group if self.ep_group.size() > 1 else None
        outputs = ep_exchange.routed_outputs(self.experts.compute, x, r.experts, group)
        return self.kernels.moe_combine(outputs, r.weights, x.dtype).view(s, b, h), None


class StockMoELayer(MoELayer):
    """megatron's MoELayer, route -> all-gather dispatch -> SequentialMLP -> combine, minus one refusal:
    its forward raises when training at TP > 1 without sequence parallelism (a performance warning; the
    local spec's LayerNorm has no sequence parallelism). The all-gather dispatcher is correct without it
    (the TP copies of a token are gathered, and their expert-TP partials summed by the reduce-scatter)."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None, padding_mask: Any = None) -> Any:
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(hidden_states, probs)
        output, bias = self.routed_experts_compute(dispatched, probs)
        return self.postprocess(self.combine(output), shared), bias


def stock_moe_spec(provider: StockSpecProvider) -> ModuleSpec:
    experts = MLPSubmodules(linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear())
    return ModuleSpec(
        module=StockMoELayer,
        submodules=MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=experts), router=StockRouter),
    )


def kernel_moe_spec(kernels: Any) -> ModuleSpec:
    params = {"kernels": kernels}
    experts = MLPSubmodules(
        linear_fc1=ModuleSpec(module=KernelExpertColumnParallelLinear, params=params),
        linear_fc2=ModuleSpec(module=KernelExpertRowParallelLinear, params=params),
    )

    def router(config: TransformerConfig, pg_collection: Any = None) -> KernelRouter:
        return KernelRouter(config=config, pg_collection=pg_collection, kernels=kernels)

    return ModuleSpec(
        module=KernelMoELayer,
        params=params,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=KernelExperts, params=params, submodules=experts), router=router
        ),
    )
