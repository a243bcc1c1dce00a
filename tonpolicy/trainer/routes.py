"""The trainer's MoE routes: recorded from its routers during the logprob recompute (the gate compares
them with the rollout's: `routing_agreement`) and, for the off-policy control's router replay, imposed
on megatron's stock router (`trainer.router_replay`).

Routes are int32 [positions, num_layers, top_k], experts ascending, -1 in dense layers: the layout the
rollout server returns (SGLang's `routed_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter

from tonpolicy.trainer.moe_layer import StockRouter
from tonpolicy.trainer.schedule import Microbatch


def moe_routers(module: Any) -> list[Any]:
    """This rank's routers (the contract's and the stock one), one per MoE layer of its pipeline stage."""
    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def aux_loss_shares(
    module: Any, local_microbatches: int, real_microbatches: int
) -> Callable[[Microbatch], None] | None:
    """A `before_forward` hook for a training step in which all DP replicas together run
    `real_microbatches` real microbatches, this one `local_microbatches` (fillers included): each real
    microbatch's aux loss weighs 1/real_microbatches of the step's (megatron's schedule divides it by the
    local count and DDP by DP: undone here), a filler's 0. None for a dense model."""
    routers = moe_routers(module)
    if not routers:
        return None
    share = local_microbatches * ps.get_data_parallel_world_size() / real_microbatches

    def weigh(mb: Microbatch) -> None:
        for r in routers:
            r.aux_share = share if mb.weight else 0.0

    return weigh


class RouteRecorder:
    """While entered, collects every router forward's routes [N, k] (N: the microbatch's rows x
    positions, sequence-major as megatron flattens them), per global layer (0-based), in call order:
    the j-th call is the stage's j-th microbatch (a forward-only schedule runs each once, in order)."""

    def __init__(self, module: Any) -> None:
        self.routers = moe_routers(module)
        self.calls: dict[int, list[torch.Tensor]] = {}

    def _sink(self, layer: int) -> Callable[[torch.Tensor], None]:
        return lambda experts: self.calls.setdefault(layer, []).append(experts.to("cpu", torch.int32))

    def __enter__(self) -> RouteRecorder:
        for r in self.routers:
            r.route_sink = self._sink(r.layer_number - 1)
        return self

    def __exit__(self, *exc: Any) -> None:
        for r in self.routers:
            r.route_sink = None


def gather_routes(
    recorder: RouteRecorder, mbs: list[Microbatch], lengths: list[int], num_layers: int, top_k: int
) -> list[torch.Tensor] | None:
    """Per sample, on global rank 0 (None elsewhere): int32 [R, num_layers, top_k] the trainer's routes
    at the positions that predicted its R response tokens, -1 in dense layers. Collective over the world:
    each (pipeline stage, DP replica) sends its layers' routes of its own samples; TP ranks hold the same
    tokens and routes, so TP rank 0 alone sends (CP is refused for MoE)."""
    mine: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (sample, layer, response indices, [R', k])
    if ps.get_tensor_model_parallel_rank() == 0:
        for j, mb in enumerate(mbs):
            if not mb.weight:  # a filler repeats samples its own microbatch already holds
                continue
            b = mb.tokens.shape[0]
            for i, s, row in zip(mb.samples, mb.slices, mb.rows, strict=True):
                flat = s.rows * b + row
                mine += [(i, layer, s.resp, calls[j][flat]) for layer, calls in recorder.calls.items()]
    everyone: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    out = [torch.full((n, num_layers, top_k), -1, dtype=torch.int32) for n in lengths]
    for part in everyone:
        for i, layer, resp, experts in part:
            out[i][resp, layer] = experts
    return out


def replay_targets(mb: Microbatch, routes: list[torch.Tensor], layer: int, top_k: int) -> torch.Tensor:
    """int64 [s * rows, top_k] the rollout's experts of `layer` for every token of the microbatch, in
    megatron's flat token order (sequence-major). `routes[i]`: sample i's [fed positions, layers, k] (a
    padded row holds one sample from column 0, a packed row its samples one after another). Padding
    gets experts 0..k-1: routing is dropless, so a padding token's experts change no other token."""
    rows, s = mb.tokens.shape
    t = torch.arange(top_k, dtype=torch.long).expand(s, rows, top_k).clone()
    col = [0] * rows
    for i, row in zip(mb.samples, mb.rows, strict=True):
        r = routes[i][:, layer]
        if bool((r < 0).any()):
            raise ValueError(f"router replay: sample {i} has no rollout route in MoE layer {layer}")
        t[col[row] : col[row] + r.shape[0], row] = r.long()
        col[row] += r.shape[0]
    return t.reshape(s * rows, top_k)


def replayer(module: Any, routes: list[torch.Tensor], top_k: int) -> Callable[[Microbatch], None]:
    """schedule.run's `before_forward` for router replay: sets each stock router's experts for the
    microbatch about to run. Only the stock router replays (validation allows replay only with it)."""
    routers = moe_routers(module)
    if any(not isinstance(r, StockRouter) for r in routers):
        raise ValueError("router replay needs megatron's stock router (the stock layer spec)")

    def before_forward(mb: Microbatch) -> None:
        for r in routers:
            r.replay(replay_targets(mb, routes, r.layer_number - 1, top_k))

    return before_forward


def end_replay(module: Any) -> None:
    for r in moe_routers(module):
        if isinstance(r, StockRouter):
            r.replay(None)
