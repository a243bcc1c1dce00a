"""The trainer ranks' run (README "A run", item 5): rank 0 pairs with the rollout server (the contract
handshake), then every rank takes the steps, each in the order of docs/ARCHITECTURE.md "One step of the
default run" (asynchronous steps, experiment.max_staleness >= 1: the batch from rank 0's producer thread,
tonpolicy.loop.producer). A failed check ends the run with no update made (EXIT_GATE_FAILED); the
verdict goes to STATUS_FILE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from tonpolicy.config.schema import Config
from tonpolicy.contract.handshake import handshake
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.loop.checkpoints import Checkpoints
from tonpolicy.loop.collective import broadcast
from tonpolicy.loop.exit_codes import EXIT_GATE_FAILED, EXIT_HANDSHAKE, EXIT_INVALID_CONFIG, EXIT_OK
from tonpolicy.loop.faults import forgets_optimizer_state, injected_fault, with_fault_advantages, with_fault_logprobs
from tonpolicy.loop.gate_policy import Gate, Verdict
from tonpolicy.loop.logprob_reference import BeforeUpdate, FirstForward, LogprobReference, logprob_reference
from tonpolicy.loop.producer import BatchProducer
from tonpolicy.loop.records import MetricsLogger, StepRecords, write_status
from tonpolicy.loop.resume import bring_servers_to
from tonpolicy.loop.rollout_batch import Batch, Score, collect_batch
from tonpolicy.loop.step_record import StepOutcome, StepTimes, write_step_record
from tonpolicy.loop.weight_sync import WeightSync, policy_version, weight_sync_for
from tonpolicy.model.tokenizer import load_text_tokenizer, load_tokenizer
from tonpolicy.rl.prompt_data import PromptData
from tonpolicy.trainer.optimizer_state import TRAINER_STATE

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tonpolicy.trainer.worker import TrainerWorker


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
    # Asynchronous steps (experiment.max_staleness >= 1): rank 0's producer, every rank's kept versions.
    producer: BatchProducer | None = None
    snapshots: Any = None  # tonpolicy.trainer.snapshots.PolicySnapshots
    score: Score | None = None  # rank 0's: the user's reward function (reward.function), else the task's
    data: PromptData | None = None  # rank 0's: the user's prompts (data.train_files), else the task's
    # which logprobs the rollout's are held against, chosen once from the config
    reference: LogprobReference = field(init=False)

    def __post_init__(self) -> None:
        self.reference = logprob_reference(self.cfg)


def make_batch(loop: Loop, step: int) -> Batch:
    """Rank 0: step `step`'s batch from the rollout server (with the test hooks' faults)."""
    return with_fault_logprobs(with_fault_advantages(collect_batch(loop.cfg, loop.server, step, loop.score, loop.data)))


def take_step(loop: Loop, step: int) -> Verdict:
    """One step, numbered as docs/ARCHITECTURE.md "One step of the default run"; returns the gate's
    verdict (the failed check's, else the last check's)."""
    start, ref = time.monotonic(), loop.reference
    injected_fault(step)
    batch, waited = rollouts(loop, step)  # 1. rollouts
    times = StepTimes(start, time.monotonic() - start, waited)
    before = ref.before_update(loop, batch, step)  # 2-3. the recompute and its check, if any
    seen, metrics = ref.first_forward(loop, batch, before, step), {}
    if before.passed:
        metrics = train(loop, batch, before, seen, step)  # 4. the PPO/GRPO step
        if seen.verdict is not None and seen.verdict.passed:
            loop.weights.export(loop.worker, step)  # 5. export the new weights (every rank)
    verdict = seen.verdict or before.check
    assert verdict is not None
    if loop.rank0:
        write_step_record(loop, StepOutcome(step, batch, before, seen, verdict, metrics), times)  # 6.
        if verdict.passed:  # 7. the server loads the new weights
            load_new_weights(loop, step)
    return verdict


def rollouts(loop: Loop, step: int) -> tuple[Batch, float | None]:
    """The step's batch on every rank, and (rank 0, asynchronous) the wait for the producer's."""
    waited: float | None = None
    batch: Batch | None = None
    if loop.rank0:
        batch, waited = loop.producer.take(step) if loop.producer is not None else (make_batch(loop, step), None)
    batch = broadcast(batch)
    if loop.rank0:  # every token sampled by the weights last pushed, or (asynchronous) at most k versions before
        loop.weights.check_versions(batch.weight_versions, loop.cfg.experiment.max_staleness, batch.response_masks)
    if loop.cfg.trainer.router_replay:  # the recompute and the training forward route as the rollout did
        loop.worker.replay_routes(batch.routed_experts)
    return batch, waited


def train(loop: Loop, batch: Batch, before: BeforeUpdate, seen: FirstForward, step: int) -> dict[str, Any]:
    """ppo_step, its first update waiting on the gate's check of the first training forward (`seen`);
    its metrics with the reference's."""
    ref = loop.reference
    ref.before_training(loop, step)
    record_routes = loop.cfg.model.is_moe and not ref.recompute
    metrics = loop.worker.ppo_step(ref.train_samples(batch, before), seen.may_update, record_routes)
    metrics.update(ref.metrics(loop, batch, before, seen, step))
    return metrics


def load_new_weights(loop: Loop, step: int) -> None:
    """Rank 0: the server loads the step's weights (asynchronous: and the producer may start the
    batches they allow)."""
    loop.weights.push(step)
    if loop.producer is not None:
        loop.producer.pushed(policy_version(loop.weights.version) or 0)


def run_trainer(
    cfg: Config,
    run_dir: Path,
    server_url: str,
    checkpoint: str,
    device: str,
    new_logger: Callable[[], MetricsLogger],
    replica_urls: Sequence[str] = (),
) -> int:
    """Every trainer rank's body under torchrun; returns the rank's exit code (rank 0 also writes the
    verdict to STATUS_FILE). `device`: this node's ('cpu' or 'cuda'); `new_logger`: rank 0's W&B logger;
    `replica_urls`: a fleet's servers (`server_url` is then its router's)."""
    from tonpolicy.trainer.worker import TrainerWorker

    if device == "cpu":  # this node's CPU (another node's may differ from the launcher's)
        from tonpolicy.contract.host import host_problems

        problems = host_problems(cfg.model, cfg.contract)
        if problems:
            log.error("tonpolicy trainer: " + "\n".join(problems))
            return EXIT_INVALID_CONFIG
    worker = TrainerWorker(cfg, checkpoint)
    # checkpoint.resume: the launcher made the saved step's directory this run's checkpoint
    resuming = cfg.checkpoint.resume is not None and (Path(checkpoint) / TRAINER_STATE).is_file()
    start = worker.load_trainer_state(checkpoint, optimizer=not forgets_optimizer_state()) if resuming else 0
    rank0 = dist.get_rank() == 0
    server = records = refusal = tokenizer = None
    if rank0:
        from tonpolicy.rollout.fleet import rollout_client

        # A fleet's failed samples wait for the launcher's replacement: noticed, then started and healthy.
        recover_s = cfg.rollout.liveness_timeout_s + cfg.rollout.health_timeout_s
        server = rollout_client(server_url, replica_urls, cfg.rollout.client_retries, recover_s, run_dir)
        server.wait_healthy(cfg.rollout.health_timeout_s)  # launch.sh starts both at once
        refusal = handshake(cfg, server, runtime_identity(worker.kernels, cfg.contract.dtype, device))
        tokenizer = load_tokenizer(checkpoint)  # None for a checkpoint without one: ids only
        records = StepRecords(run_dir, new_logger(), tokenizer, cfg.logger.samples_every)
    refusal = broadcast(refusal)
    if refusal:
        if rank0:
            log.error(f"tonpolicy: refusing to train: {refusal}")
            write_status(run_dir, EXIT_HANDSHAKE, refusal)
        worker.close()
        return EXIT_HANDSHAKE

    loop = Loop(cfg, worker, Gate.of(cfg), weight_sync_for(cfg, server, run_dir, device), rank0, server, records)
    if rank0 and cfg.reward.function is not None:
        from tonpolicy.rl.user_reward import UserReward

        r = cfg.reward
        decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        loop.score = UserReward(
            r.function, timeout_s=r.timeout_s, on_error=r.on_error, batched=r.batched, decode=decode
        )
    evaluation = None
    if rank0 and (cfg.data.train_files or cfg.data.val_files):  # the launcher checked both before the start
        from tonpolicy.loop.evaluation import Evaluation
        from tonpolicy.rl.prompt_data import load_prompt_data

        text_tokenizer = load_text_tokenizer(checkpoint)
        if cfg.data.train_files:
            loop.data = load_prompt_data(cfg, text_tokenizer)
        if cfg.data.val_files:
            held_out = load_prompt_data(cfg, text_tokenizer, cfg.data.val_files)
            evaluation = Evaluation(cfg, held_out, loop.score, run_dir)
    k = cfg.experiment.max_staleness
    if k:
        from tonpolicy.trainer.snapshots import PolicySnapshots

        loop.snapshots = PolicySnapshots(worker, k)
        if rank0:
            loop.producer = BatchProducer(lambda j: make_batch(loop, j), cfg.experiment.steps, k)
    code, message = EXIT_OK, ""
    checkpoints = Checkpoints(cfg, run_dir, rank0)
    if start:
        bring_servers_to(loop, checkpoint, start)
    try:
        for step in range(start, cfg.experiment.steps):
            verdict = take_step(loop, step)
            if verdict.failed:
                code, message = EXIT_GATE_FAILED, loop.gate.failure_message(verdict, step)
                break
            checkpoints.after_step(worker, step)
            if evaluation is not None and evaluation.due(step + 1):
                evaluation.run(server, step, records.logger)
    finally:
        if loop.producer is not None:  # a batch still being generated is dropped (it trains nothing)
            loop.producer.close()
    loop.weights.close()
    if records is not None:
        records.finish(code, message)
    worker.close()
    return code  # non-zero fails a hand-run launch.sh too; the launcher reads the status file
