"""The trainer ranks' run (README "A run", item 5; docs/ARCHITECTURE.md "One step of the default run").

Rank 0 pairs with the rollout server (the contract handshake), then every step, on every rank:
  1. rollouts: rank 0 has the server sample the step's prompts (logprobs from the decode step that
     sampled each token), scores rewards and GRPO advantages, and broadcasts the batch;
  2. recompute: the trainer recomputes the logprobs at the configured layout (an MoE model's routes
     recorded too; with trainer.router_replay its stock router takes the rollout's routes);
  3. gate, first check: rollout == recompute (and, for an MoE model, routing_agreement);
  4. PPO/GRPO step, whose update waits on the gate's second check: recompute == first training forward;
  5. export the new weights (an HF checkpoint, or gathered for the process group);
  6. rank 0 appends the step record and samples (and logs them to W&B);
  7. rank 0 has the server load the new weights.
A failed check ends the run with no update made (EXIT_GATE_FAILED); the verdict goes to STATUS_FILE.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tonpolicy.config.schema import Config
from tonpolicy.contract.handshake import handshake
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.loop.batch import Batch, collect_batch
from tonpolicy.loop.exit_codes import EXIT_GATE_FAILED, EXIT_HANDSHAKE, EXIT_INVALID_CONFIG, EXIT_OK
from tonpolicy.loop.faults import injected_fault, with_fault_advantages
from tonpolicy.loop.gate import Gate, Verdict, routing_agreement
from tonpolicy.loop.records import MetricsLogger, StepRecords, write_status
from tonpolicy.loop.weight_sync import WeightSync, weight_sync_for
from tonpolicy.model.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from tonpolicy.trainer.worker import TrainerWorker


def broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Loop:
    """What every step uses. `server` (the rollout client) and `records` are rank 0's, None elsewhere."""

    cfg: Config
    worker: TrainerWorker
    gate: Gate
    weights: WeightSync
    rank0: bool
    server: Any
    records: StepRecords | None


def take_step(loop: Loop, step: int) -> Verdict:
    """One step; returns the gate's verdict (the failed check's, else the last check's)."""
    cfg, worker, gate = loop.cfg, loop.worker, loop.gate
    t0 = time.monotonic()
    injected_fault(step)
    # 1. rollouts
    batch = broadcast(with_fault_advantages(collect_batch(cfg, loop.server, step)) if loop.rank0 else None)
    t_rollout = time.monotonic() - t0
    # 2. recompute
    if cfg.trainer.router_replay:  # the recompute and the training forward route as the rollout did
        worker.replay_routes(batch.routed_experts)
    recompute = worker.logprobs(batch.prompts, batch.responses)
    # 3. gate, first check (rank 0's verdict, for every rank)
    verdict = first = broadcast(gate.rollout_vs_recompute(batch.rollout_logprobs, recompute) if loop.rank0 else None)
    metrics: dict[str, Any] = {}
    if first.passed:
        # 4. PPO/GRPO step; the second check sees the training forward before the update, on every rank
        second: list[Verdict] = []

        def may_update(first_forward: list[torch.Tensor]) -> bool:
            second.append(gate.recompute_vs_first_forward(recompute, first_forward))
            return second[0].passed

        metrics = worker.ppo_step(
            batch.prompts,
            batch.responses,
            old_logprobs=recompute,
            rollout_logprobs=batch.rollout_logprobs,
            advantages=batch.advantages,
            may_update=may_update,
        )
        verdict = second[0]
        metrics.update(
            first_forward_mismatched=verdict.report.mismatched_tokens,
            first_forward_max_abs_diff=verdict.report.max_abs_logprob_diff,
        )
        # 5. export the new weights (every rank takes part)
        if verdict.passed:
            loop.weights.export(worker, step)
    if loop.rank0:
        # 6. the step record and samples
        parity = first.report
        routing: dict[str, float | None] = {}
        if cfg.model.is_moe:  # null when the server gave no routes; absent for a dense model
            routing["routing_agreement"] = _routing_agreement(cfg, batch, worker.last_routes)
        record = {
            "step": step,
            **parity.to_dict(),
            **routing,
            **metrics,
            "gate": "failed" if verdict.failed else "passed",
            "gate_check": verdict.failed_check,
            "reward_mean": batch.reward_mean,
            "rollout_s": round(t_rollout, 3),
            "step_s": round(time.monotonic() - t0, 3),
        }
        loop.records.write(record, batch)
        print(
            f"step {step}: tokens={parity.tokens_scored} mismatched={parity.mismatched_tokens} "
            f"max|Δ|={parity.max_abs_logprob_diff:.3e} grad_norm={metrics.get('grad_norm')}"
            + (f" routing_agreement={routing['routing_agreement']}" if routing else ""),
            flush=True,
        )
        # 7. the server loads the new weights
        if verdict.passed:
            loop.weights.push(step)
    return verdict


def _routing_agreement(cfg: Config, batch: Batch, trainer_routes: list[torch.Tensor] | None) -> float | None:
    if batch.routed_experts is None or trainer_routes is None:
        return None
    m = cfg.model
    moe_layers = [n for n in range(m.num_layers) if m.is_moe_layer(n)]
    return routing_agreement(batch.routed_experts, trainer_routes, [len(p) for p in batch.prompts], moe_layers)


def run_trainer(
    cfg: Config,
    run_dir: Path,
    server_url: str,
    checkpoint: str,
    device: str,
    new_logger: Callable[[], MetricsLogger],
) -> int:
    """Every trainer rank's body under torchrun; returns the rank's exit code (rank 0 also writes the
    verdict to STATUS_FILE). `device`: this node's ('cpu' or 'cuda'); `new_logger`: rank 0's W&B logger."""
    from tonpolicy.trainer.worker import TrainerWorker

    if device == "cpu":  # this node's CPU (another node's may differ from the launcher's)
        from tonpolicy.contract.host import host_problems

        problems = host_problems(cfg.model, cfg.contract)
        if problems:
            print("tonpolicy trainer: " + "\n".join(problems), file=sys.stderr, flush=True)
            return EXIT_INVALID_CONFIG
    worker = TrainerWorker(cfg, checkpoint)
    rank0 = dist.get_rank() == 0
    server = records = refusal = None
    if rank0:
        from tonpolicy.rollout.client import RolloutClient

        server = RolloutClient(server_url)
        server.wait_healthy(cfg.rollout.health_timeout_s)  # launch.sh starts both at once
        refusal = handshake(cfg, server, runtime_identity(worker.kernels, cfg.contract.dtype, device))
        tokenizer = load_tokenizer(checkpoint)  # None for a checkpoint without one: ids only
        records = StepRecords(run_dir, new_logger(), tokenizer)
    refusal = broadcast(refusal)
    if refusal:
        if rank0:
            print(f"tonpolicy: refusing to train: {refusal}", file=sys.stderr)
            write_status(run_dir, EXIT_HANDSHAKE, refusal)
        worker.close()
        return EXIT_HANDSHAKE

    loop = Loop(cfg, worker, Gate.of(cfg), weight_sync_for(cfg, server, run_dir, device), rank0, server, records)
    code, message = EXIT_OK, ""
    for step in range(cfg.experiment.steps):
        verdict = take_step(loop, step)
        if verdict.failed:
            code, message = EXIT_GATE_FAILED, loop.gate.failure_message(verdict, step)
            break
    loop.weights.close()
    if records is not None:
        records.finish(code, message)
    worker.close()
    return code  # non-zero fails a hand-run launch.sh too; the launcher reads the status file
