"""Rank 0's record of one step (a line of metrics.jsonl, its samples, W&B) and the line it logs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tonpolicy.config.schema import Config
from tonpolicy.loop.gate_policy import Verdict, routing_agreement
from tonpolicy.loop.logprob_reference import BeforeUpdate, FirstForward
from tonpolicy.loop.rollout_batch import Batch
from tonpolicy.rollout.fleet import fleet_events

if TYPE_CHECKING:
    from tonpolicy.loop.run import Loop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    """What a step did: its batch, the checks before and in the first training forward, the verdict
    (the failed check's, else the last one's) and ppo_step's metrics with the reference's (empty when
    nothing trained)."""

    step: int
    batch: Batch
    before: BeforeUpdate
    seen: FirstForward
    verdict: Verdict
    metrics: dict[str, Any]


@dataclass(frozen=True)
class StepTimes:
    start: float  # time.monotonic() when the step began
    rollout_s: float  # asynchronous: the wait for the producer's batch and its broadcast
    rollout_wait_s: float | None  # asynchronous: the wait for the producer's batch alone


def write_step_record(loop: Loop, outcome: StepOutcome, times: StepTimes) -> None:
    cfg, batch, step, verdict = loop.cfg, outcome.batch, outcome.step, outcome.verdict
    assert loop.records is not None
    parity = (outcome.before.check or verdict).report
    samples, trained = loop.reference.compared(batch, outcome.before, outcome.seen)
    routing: dict[str, float | None] = {}
    if cfg.model.is_moe:  # null when the server gave no routes; absent for a dense model
        routing["routing_agreement"] = _routing_agreement(cfg, batch, loop.worker.last_routes, samples)
    record = {
        "step": step,
        **parity.to_dict(),
        **routing,
        **outcome.metrics,
        "recompute": loop.reference.recompute,
        # samples whose rollout logprobs the gate compared with the trainer's, bit for bit
        "gate_samples": len(samples),
        "gate": "failed" if verdict.failed else "passed",
        "gate_check": verdict.failed_check,
        "reward_mean": batch.reward_mean,
        "model_tokens": batch.model_tokens,  # scored by the gate (a multi-turn task's: not the env's)
        "cached_tokens": batch.cached_tokens,  # context tokens the server reused from its prefix cache
        "reward_errors": batch.reward_errors,  # calls of the user's reward function that failed (scored 0.0)
        # HTTP requests to the rollout servers re-sent since the last record (a transient error retried)
        "rollout_retries": loop.server.take_retries(),
        # a fleet's: members the launcher replaced, samples and loads re-sent once it was whole again
        **fleet_events(loop.server),
        "rollout_s": round(times.rollout_s, 3),
        **({"rollout_wait_s": round(times.rollout_wait_s, 3)} if times.rollout_wait_s is not None else {}),
        "step_s": round(time.monotonic() - times.start, 3),
        "time": round(time.time(), 3),  # when the record was written (unix seconds): steps end to end
    }
    loop.records.write(record, batch, trained)
    log.info(
        f"step {step}: tokens={parity.tokens_scored} mismatched={parity.mismatched_tokens} "
        f"max|Δ|={parity.max_abs_logprob_diff:.3e} grad_norm={outcome.metrics.get('grad_norm')}"
        + (f" routing_agreement={routing['routing_agreement']}" if routing else "")
    )


def _routing_agreement(
    cfg: Config, batch: Batch, trainer_routes: list[torch.Tensor] | None, samples: list[int]
) -> float | None:
    """Over `samples` (those `trainer_routes` holds, in order)."""
    if batch.routed_experts is None or trainer_routes is None:
        return None
    m = cfg.model
    moe_layers = [n for n in range(m.num_layers) if m.is_moe_layer(n)]
    rollout = [batch.routed_experts[i] for i in samples]
    return routing_agreement(rollout, trainer_routes, [len(batch.prompts[i]) for i in samples], moe_layers)
