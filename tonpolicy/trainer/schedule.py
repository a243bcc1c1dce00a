"""Run (prompt, response) samples through GPTModel with megatron's own forward/backward schedule
(1F1B across pipeline stages), one sample per microbatch, and collect per-response-token results.

Data parallelism: each DP replica scores and trains on its own share of the batch (`dp_share`,
round-robin), and `assemble` gathers every replica's results so all ranks hold the whole batch.

Every microbatch is padded to the same length (megatron's p2p shapes are static); padding sits after
the real tokens, which causal attention never lets back in. Under CP each rank holds its positions
(contiguous for Ulysses, zigzag for ring) and `cp_layout.slice_responses` picks its response rows.
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

from tonpolicy.config.layout import Layout
from tonpolicy.trainer import cp_layout
from tonpolicy.trainer.kernel_modules import lm_head_rows
from tonpolicy.trainer.logprobs import token_logprobs
from tonpolicy.trainer.process_groups import device

LossFn = Callable[["Microbatch", torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class Microbatch:
    """Samples that run forward together: one per batch row (padded), or several packed into row 0
    (each restarting at position 0, so the contract attention splits the row at those starts)."""

    samples: list[int]  # each sample's place in the whole batch
    tokens: torch.Tensor  # [rows, s_local]
    positions: torch.Tensor  # [rows, s_local] absolute positions (per sample when packed)
    rows: list[int]  # the batch row each sample sits in
    slices: list[cp_layout.ResponseSlice]  # per sample: its row's local positions predicting its response
    targets: list[torch.Tensor]  # per sample: [R] response token ids
    extras: list[dict[str, torch.Tensor]]  # per sample: per-response-token training inputs, full length R
    weight: float = 1.0  # 0: a filler that only keeps the EP exchanges in step (its loss counts nothing)


def dp_share(num_samples: int, replica: int | None = None) -> list[int]:
    """Indices of the samples a data-parallel replica (default: this one) scores and trains on."""
    dp = ps.get_data_parallel_world_size()
    return list(range(ps.get_data_parallel_rank() if replica is None else replica, num_samples, dp))


def real_microbatches(num_samples: int, micro_batch_size: int) -> int:
    """The real (not filler) microbatches of a batch over all DP replicas."""
    dp = ps.get_data_parallel_world_size()
    return sum(-(-len(dp_share(num_samples, r)) // micro_batch_size) for r in range(dp))


def make_microbatches(
    prompts: list[list[int]],
    responses: list[list[int]],
    layout: Layout,
    tile: int,
    extras: list[dict[str, torch.Tensor]] | None = None,
    micro_batch_size: int = 1,
    pack: bool = False,
) -> tuple[list[Microbatch], int]:
    """This rank's microbatches (its DP share, `micro_batch_size` samples each) plus the common padded
    sequence length (the same on every replica: Megatron's pipeline shapes are static). The CP split is
    the layout's; the DP size is read from the live groups (Megatron derives it from the world size)."""
    cp, cp_type, rank = layout.cp, layout.cp_type, ps.get_context_parallel_rank()
    if pack and cp > 1:
        raise ValueError("packed sequences are not split for context parallelism")
    extras = extras if extras is not None else [{} for _ in prompts]
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True)]  # the last token predicts nothing
    share = dp_share(len(prompts))
    groups = [share[k : k + micro_batch_size] for k in range(0, len(share), micro_batch_size)]
    real = len(groups)
    if ps.get_expert_model_parallel_world_size() > 1:
        # Every MoE layer's forward and backward exchange tokens over the EP group, which spans DP
        # replicas: each replica runs as many microbatches as the largest share (fillers repeat a group
        # with loss weight 0, whose results are not read).
        dp = ps.get_data_parallel_world_size()
        most = max(-(-len(dp_share(len(prompts), r)) // micro_batch_size) for r in range(dp))
        filler = groups[0] if groups else dp_share(len(prompts), 0)[:micro_batch_size]
        groups += [filler] * (most - real)
    if pack:  # every replica's rows as long as the longest packed group of the whole batch
        everyone = [dp_share(len(prompts), r) for r in range(ps.get_data_parallel_world_size())]
        seq_len = max(
            sum(lengths[i] for i in g[k : k + micro_batch_size])
            for g in everyone
            for k in range(0, len(g), micro_batch_size)
        )
    else:
        pad = layout.pad_multiple(tile)
        seq_len = -(-max(lengths) // pad) * pad
    local = cp_layout.local_positions(seq_len, cp, rank, cp_type)

    def ids_of(i: int) -> torch.Tensor:
        return torch.tensor(list(prompts[i]) + list(responses[i])[:-1], dtype=torch.long)

    mbs = []
    for n, g in enumerate(groups):
        if pack:
            tokens = torch.cat([ids_of(i) for i in g])
            pos = torch.cat([torch.arange(lengths[i]) for i in g])
            pad = seq_len - tokens.numel()  # padding is a segment of its own, starting at position 0
            tokens, pos = torch.cat([tokens, tokens.new_zeros(pad)]), torch.cat([pos, torch.arange(pad)])
            starts = torch.tensor([0, *[lengths[i] for i in g]]).cumsum(0)
            slices = [
                cp_layout.shift(
                    cp_layout.response_slice(torch.arange(lengths[i]), len(prompts[i]), len(responses[i])),
                    int(starts[k]),
                )
                for k, i in enumerate(g)
            ]
            mbs.append(
                Microbatch(
                    g,
                    tokens[None],
                    pos[None],
                    [0] * len(g),
                    slices,
                    [torch.tensor(responses[i], dtype=torch.long) for i in g],
                    [extras[i] for i in g],
                    1.0 if n < real else 0.0,
                )
            )
        else:
            rows = [torch.cat([ids_of(i), torch.zeros(seq_len - lengths[i], dtype=torch.long)])[local] for i in g]
            mbs.append(
                Microbatch(
                    g,
                    torch.stack(rows),
                    local.expand(len(g), -1),
                    list(range(len(g))),
                    [cp_layout.response_slice(local, len(prompts[i]), len(responses[i])) for i in g],
                    [torch.tensor(responses[i], dtype=torch.long) for i in g],
                    [extras[i] for i in g],
                    1.0 if n < real else 0.0,
                )
            )
    return mbs, seq_len


def local_logprobs(
    mb: Microbatch, logits: torch.Tensor, vocab_size: int, temperature: float, kernels: Any, stock_gather: bool = False
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Per sample: fp32 logprobs of the response tokens whose predicting row is on this rank, and its
    per-response-token tensors (targets, extras) sliced to the same tokens. `logits` is this TP rank's
    vocab shard [rows, s_local, V_pad/TP]. One logprob call for the whole microbatch (row-wise kernels:
    a token's bits do not depend on the other rows)."""
    per_response = [{"targets": t, **ex} for t, ex in zip(mb.targets, mb.extras, strict=True)]
    picked = cp_layout.slice_responses([logits[r] for r in mb.rows], per_response, mb.slices)
    rows = torch.cat([x for x, _ in picked])
    sliced = [{k: v.to(rows.device) for k, v in y.items()} for _, y in picked]
    targets = torch.cat([y["targets"] for y in sliced])
    lp = token_logprobs(rows, targets, vocab_size, temperature, kernels, stock_gather)
    return list(lp.split([y["targets"].numel() for y in sliced])), sliced


def read_rows(mb: Microbatch) -> torch.Tensor:
    """Flat indices into the model's [s_local * rows] hidden rows (sequence-major, as Megatron lays
    them out) of the rows whose logits the loss reads: the ones predicting a response token."""
    b = mb.tokens.shape[0]
    return torch.cat([s.rows * b + r for s, r in zip(mb.slices, mb.rows, strict=True)]).unique()


def run(
    model: Any,
    mbs: list[Microbatch],
    seq_len: int,
    loss_fn: LossFn,
    forward_only: bool,
    kernel_spec: bool,
    before_forward: Callable[[Microbatch], None] | None = None,
) -> list[dict]:
    """Megatron schedule over the microbatches; returns loss_fn's dicts (last pipeline stage only).
    `kernel_spec`: the model's attention takes the microbatch's positions (Megatron's stock spec
    applies its own RoPE and would read them as THD packing parameters). `before_forward`: called with
    each microbatch just before this stage's forward of it (router replay sets its routes there)."""
    it = iter(mbs)

    def forward_step(data_iterator: Any, module: Any) -> tuple[torch.Tensor, Callable]:
        mb = next(data_iterator)
        if before_forward is not None:
            before_forward(mb)
        dev = device()
        positions = mb.positions.to(dev)
        if not kernel_spec:
            return module(mb.tokens.to(dev), positions, None), functools.partial(loss_fn, mb)
        carried = cp_layout.TokenPositions(positions=positions)
        with lm_head_rows(module, read_rows(mb).to(dev)):
            out = module(mb.tokens.to(dev), positions, None, packed_seq_params=carried)
        return out, functools.partial(loss_fn, mb)

    fb = get_forward_backward_func()
    rows = {mb.tokens.shape[0] for mb in mbs}
    if len(rows) > 1:
        raise ValueError(f"microbatches of different sizes {sorted(rows)}: the pipeline's shapes are static")
    return fb(
        forward_step_func=forward_step,
        data_iterator=it,
        model=[model],
        num_microbatches=len(mbs),
        seq_length=seq_len,
        micro_batch_size=rows.pop() if rows else 1,
        forward_only=forward_only,
    )


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
            if not mb.weight:  # a filler: its samples are written by their own microbatch
                continue
            for i, resp, val in zip(mb.samples, out["resp"], out[key], strict=True):
                flat[offsets[i] + resp] = val.detach().float()
        if ps.get_context_parallel_world_size() > 1:
            dist.all_reduce(flat, group=ps.get_context_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            flat, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        shares = [torch.empty_like(flat) for _ in range(dp)]
        dist.all_gather(shares, flat, group=ps.get_data_parallel_group())
        owner = torch.cat([torch.full((n,), i % dp, dtype=torch.long) for i, n in enumerate(lengths)]).to(dev)
        flat = torch.stack(shares).gather(0, owner[None])[0]
    return list(flat.cpu().split(lengths))
