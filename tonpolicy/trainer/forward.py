"""Run (prompt, response) samples through GPTModel with megatron's own forward/backward schedule
(1F1B across pipeline stages), one sample per microbatch, and collect per-response-token results.

Data parallelism: each DP replica scores and trains on its own share of the batch (`dp_share`,
round-robin), and `assemble` gathers every replica's results so all ranks hold the whole batch.

Every microbatch is padded to the same length (megatron's p2p shapes are static); padding sits after
the real tokens, which causal attention never lets back in. Under CP each rank holds its positions
(contiguous for Ulysses, zigzag for ring) and `cp.slice_responses` picks its response rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from tonpolicy.trainer import cp as cp_layout
from tonpolicy.trainer.dist import device
from tonpolicy.trainer.logprobs import token_logprobs

LossFn = Callable[["Microbatch", torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class Microbatch:
    index: int
    tokens: torch.Tensor  # [1, s_local]
    positions: torch.Tensor  # [1, s_local] absolute positions
    slice: cp_layout.ResponseSlice
    targets: torch.Tensor  # [R] response token ids
    extras: dict[str, torch.Tensor]  # per-response-token training inputs, full length R


def dp_share(num_samples: int) -> list[int]:
    """Indices of the samples this data-parallel replica scores and trains on."""
    return list(range(ps.get_data_parallel_rank(), num_samples, ps.get_data_parallel_world_size()))


def make_microbatches(prompts: list[list[int]], responses: list[list[int]], cp_mode: str, tile: int,
                      extras: list[dict[str, torch.Tensor]] | None = None) -> tuple[list[Microbatch], int]:
    """This rank's microbatches (its DP share; `index` is the sample's place in the whole batch) plus
    the common padded (full) sequence length, the same on every replica."""
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    longest = max(len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True))
    seq_len = cp_layout.padded_len(longest, cp, cp_mode, tile)
    local = cp_layout.local_positions(seq_len, cp, rank, cp_mode)
    extras = extras if extras is not None else [{} for _ in prompts]
    mbs = []
    for i in dp_share(len(prompts)):
        p, r, ex = prompts[i], responses[i], extras[i]
        ids = torch.tensor(list(p) + list(r)[:-1], dtype=torch.long)  # the last token predicts nothing
        ids = torch.cat([ids, ids.new_zeros(seq_len - ids.numel())])
        mbs.append(Microbatch(i, ids[local][None], local[None], cp_layout.response_slice(local, len(p), len(r)),
                              torch.tensor(r, dtype=torch.long), ex))
    return mbs, seq_len


def local_logprobs(mb: Microbatch, logits: torch.Tensor, vocab_size: int, temperature: float,
                   kernels: Any, stock_gather: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fp32 logprobs of the response tokens whose predicting row is on this rank, and the microbatch's
    per-response-token tensors (targets, extras) sliced to the same tokens. `logits` is this TP rank's
    vocab shard [1, s_local, V_pad/TP]."""
    per_response = {"targets": mb.targets, **mb.extras}
    [(rows, sliced)] = cp_layout.slice_responses([logits[0]], [per_response], [mb.slice])
    sliced = {k: v.to(rows.device) for k, v in sliced.items()}
    lp = token_logprobs(rows, sliced["targets"], vocab_size, temperature, kernels, stock_gather)
    return lp, sliced


def run(model: Any, mbs: list[Microbatch], seq_len: int, loss_fn: LossFn, forward_only: bool) -> list[dict]:
    """Megatron schedule over the microbatches; returns loss_fn's dicts (last pipeline stage only)."""
    it = iter(mbs)

    def forward_step(data_iterator: Any, module: Any) -> tuple[torch.Tensor, Callable]:
        mb = next(data_iterator)
        dev = device()
        positions = mb.positions.to(dev)
        cp_layout.set_positions(positions)
        out = module(mb.tokens.to(dev), positions, None)
        return out, functools.partial(loss_fn, mb)

    fb = get_forward_backward_func()
    return fb(forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=len(mbs),
              seq_length=seq_len, micro_batch_size=1, forward_only=forward_only)


def assemble(outputs: list[dict], mbs: list[Microbatch], lengths: list[int], key: str = "lp") -> list[torch.Tensor]:
    """Full per-sample response vectors (`lengths` per sample of the whole batch) on every rank: each
    CP rank scatters its tokens into zeros, a CP all-reduce fills them in (disjoint, so exact), the
    last stage broadcasts to its pipeline, and the DP replicas exchange their shares (each sample is
    taken from the replica that owns it: a copy, never a sum)."""
    dev = device()  # NCCL collectives need device tensors
    flat = torch.zeros(sum(lengths), dtype=torch.float32, device=dev)
    offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    if ps.is_pipeline_last_stage():
        for out, mb in zip(outputs, mbs, strict=True):
            flat[offsets[mb.index] + out["resp"]] = out[key].detach().float()
        if ps.get_context_parallel_world_size() > 1:
            dist.all_reduce(flat, group=ps.get_context_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        shares = [torch.empty_like(flat) for _ in range(dp)]
        dist.all_gather(shares, flat, group=ps.get_data_parallel_group())
        owner = torch.cat([torch.full((n,), i % dp, dtype=torch.long) for i, n in enumerate(lengths)]).to(dev)
        flat = torch.stack(shares).gather(0, owner[None])[0]
    return list(flat.cpu().split(lengths))
