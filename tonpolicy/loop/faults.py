"""Test hooks set through $TONPOLICY_FAULT (never in a configuration): faults the tests inject into a
real run, a planted logprob mismatch (the gate's test), and a deliberately broken update (the learning
test's negative control)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from tonpolicy.loop.rollout_batch import Batch


def injected_fault(step: int) -> None:
    """Test hooks: TONPOLICY_FAULT=rank_exit:<rank>:<step> makes that rank die abruptly;
    rank_disk_full:<rank>:<step> makes it raise the OSError a full disk raises."""
    spec = os.environ.get("TONPOLICY_FAULT", "")
    kind, _, rest = spec.partition(":")
    if kind in ("rank_exit", "rank_disk_full"):
        rank, at = rest.split(":")
        if dist.get_rank() == int(rank) and step == int(at):
            if kind == "rank_exit":
                os._exit(17)
            raise OSError(28, "No space left on device")


def with_fault_advantages(batch: Batch) -> Batch:
    """TONPOLICY_FAULT=flip_advantages: the advantages' sign flipped, so the update unlearns."""
    if os.environ.get("TONPOLICY_FAULT") == "flip_advantages":
        return replace(batch, advantages=[-a for a in batch.advantages])
    return batch


def with_fault_logprobs(batch: Batch) -> Batch:
    """TONPOLICY_FAULT=flip_rollout_logprob: the first sample's first rollout logprob one bit off (its
    fp32 pattern's lowest bit), a mismatch the gate must catch before any update."""
    if os.environ.get("TONPOLICY_FAULT") != "flip_rollout_logprob" or not batch.rollout_logprobs[0].numel():
        return batch
    first = batch.rollout_logprobs[0].clone()
    first.view(torch.int32)[0] ^= 1
    return replace(batch, rollout_logprobs=[first, *batch.rollout_logprobs[1:]])


def forgets_optimizer_state() -> bool:
    """TONPOLICY_FAULT=resume_without_optimizer_state: a resumed run restores the weights but starts the
    optimizer afresh (the control that shows a resume must carry the optimizer's state)."""
    return os.environ.get("TONPOLICY_FAULT") == "resume_without_optimizer_state"
