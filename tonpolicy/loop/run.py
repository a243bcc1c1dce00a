"""The trainer ranks' run (README "A run", item 5; docs/ARCHITECTURE.md "One step of the default run").

Rank 0 pairs with the rollout server (the contract handshake), then every step, on every rank:
  1. rollouts: rank 0 has the server sample the step's prompts (logprobs from the decode step that
     sampled each token), scores rewards and GRPO advantages, and broadcasts the batch;
  2. recompute, only with trainer.recompute_logprobs (by default where the contract does not promise
     exact zero, e.g. contract=off_policy): the trainer recomputes the logprobs at the configured layout
     (an MoE model's routes recorded too; with trainer.router_replay its stock router takes the rollout's
     routes);
  3. gate, first check (with the recompute): rollout == recompute (and, for an MoE model, routing_agreement);
  4. PPO/GRPO step (trainer.ppo_epochs x trainer.ppo_minibatches updates), whose first update waits on
     the gate's check of the first training forward, the one before any update: == recompute, or without
     the recompute (the default job) == rollout, bit for bit, and PPO's old logprobs are the rollout's;
  5. export the new weights (an HF checkpoint, or gathered for the process group);
  6. rank 0 appends the step record and samples (and logs them to W&B);
  7. rank 0 has the server load the new weights.
A failed check ends the run with no update made (EXIT_GATE_FAILED); the verdict goes to STATUS_FILE.

Asynchronous steps (experiment.max_staleness=k >= 1; README "Asynchronous steps"): rank 0's producer
thread (tonpolicy.loop.producer) generates batch j once the servers serve version >= j - k, so step 1
takes a batch already generated while step j - 1 trained. Steps 2-3 become: the trainer's logprobs
under the version that sampled each token (a no-grad forward under the kept weights of each older
version, tonpolicy.trainer.snapshots; the current version's from the first training forward, or with
several updates per step from a no-grad proximal forward), compared with the rollout's bit for bit
before any update (`rollout_vs_sampling_version`); then decoupled PPO with the proximal (current)
logprobs as PPO's old ones and the rollout's as the behaviour policy (importance weights, trainer.tis_cap).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tonpolicy.config.schema import Config
from tonpolicy.contract.handshake import handshake
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.loop.batch import Batch, Score, collect_batch
from tonpolicy.loop.checkpoints import Checkpoints
from tonpolicy.loop.exit_codes import EXIT_GATE_FAILED, EXIT_HANDSHAKE, EXIT_INVALID_CONFIG, EXIT_OK
from tonpolicy.loop.faults import forgets_optimizer_state, injected_fault, with_fault_advantages, with_fault_logprobs
from tonpolicy.loop.gate import Gate, Verdict, model_tokens, recomputes_logprobs, routing_agreement
from tonpolicy.loop.producer import BatchProducer
from tonpolicy.loop.records import MetricsLogger, StepRecords, by_sample, write_status
from tonpolicy.loop.resume import bring_servers_to
from tonpolicy.loop.staleness import async_metrics, logprobs_under_sampling_versions, token_versions, with_current
from tonpolicy.loop.weight_sync import WeightSync, policy_version, weight_sync_for
from tonpolicy.model.tokenizer import load_text_tokenizer, load_tokenizer
from tonpolicy.rl.objective import train_rollout_metrics
from tonpolicy.rl.prompt_data import PromptData
from tonpolicy.rollout.fleet import fleet_events
from tonpolicy.trainer.optimizer_state import TRAINER_STATE

log = logging.getLogger(__name__)

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
    # Asynchronous steps (experiment.max_staleness >= 1): rank 0's producer, every rank's kept versions.
    producer: BatchProducer | None = None
    snapshots: Any = None  # tonpolicy.trainer.snapshots.PolicySnapshots
    score: Score | None = None  # rank 0's: the user's reward function (reward.function), else the task's
    data: PromptData | None = None  # rank 0's: the user's prompts (data.train_files), else the task's


def make_batch(loop: Loop, step: int) -> Batch:
    """Rank 0: step `step`'s batch from the rollout server (with the test hooks' faults)."""
    return with_fault_logprobs(with_fault_advantages(collect_batch(loop.cfg, loop.server, step, loop.score, loop.data)))


def take_step(loop: Loop, step: int) -> Verdict:
    """One step; returns the gate's verdict (the failed check's, else the last check's)."""
    cfg, worker, gate = loop.cfg, loop.worker, loop.gate
    stale_ok = cfg.experiment.max_staleness
    # Asynchronous steps need the proximal (current-policy) logprobs: with one update per step (the
    # default) the first training forward is that forward; with several, a no-grad forward before them.
    single_update = cfg.trainer.ppo_minibatches * cfg.trainer.ppo_epochs == 1
    recompute = recomputes_logprobs(cfg) or (stale_ok > 0 and not single_update)
    t0 = time.monotonic()
    injected_fault(step)
    # 1. rollouts (asynchronous: the producer's batch, likely generated while the last step trained)
    waited: float | None = None
    if loop.rank0 and loop.producer is not None:
        batch, waited = loop.producer.take(step)
    batch = broadcast((batch if loop.producer is not None else make_batch(loop, step)) if loop.rank0 else None)
    t_rollout = time.monotonic() - t0
    if loop.rank0:  # every token sampled by the weights last pushed, or (asynchronous) at most k versions before
        loop.weights.check_versions(batch.weight_versions, stale_ok, batch.response_masks)
    if cfg.trainer.router_replay:  # the recompute and the training forward route as the rollout did
        worker.replay_routes(batch.routed_experts)
    # 2-3. the recompute and the gate's first check (rank 0's verdict, for every rank); without the
    # recompute PPO's old logprobs are the rollout's, and the one check is on the first training forward
    first: Verdict | None = None
    old = batch.rollout_logprobs
    versions: list[list[int]] = []
    sampled: list[torch.Tensor] = []
    if stale_ok:  # the older versions' tokens under their kept weights (the current one's: proximal)
        versions = token_versions(batch.weight_versions)
    if recompute:
        old = worker.logprobs(batch.prompts, batch.responses)
        if stale_ok:  # the trainer under each token's sampling version, against the rollout
            sampled = logprobs_under_sampling_versions(
                loop.snapshots, batch.prompts, batch.responses, versions, step, old
            )
            first = broadcast(
                gate.rollout_vs_sampling_version(batch.rollout_logprobs, sampled, batch.response_masks)
                if loop.rank0
                else None
            )
        else:
            first = broadcast(
                gate.rollout_vs_recompute(batch.rollout_logprobs, old, batch.response_masks) if loop.rank0 else None
            )
    elif stale_ok:  # the current version's tokens are filled in from the first training forward
        sampled = logprobs_under_sampling_versions(loop.snapshots, batch.prompts, batch.responses, versions, step, None)
    verdict = first
    metrics: dict[str, Any] = {}
    checked: list[int] = []
    if first is None or first.passed:
        # 4. PPO/GRPO step; the first-forward check sees, on every rank, the forward that precedes every
        # update (the first minibatch's samples) and may refuse the update
        checks: list[Verdict] = []
        seen: list[torch.Tensor] = []

        def may_update(samples: list[int], first_forward: list[torch.Tensor]) -> bool:
            ref = [old[i] for i in samples]
            if stale_ok and not recompute:  # every token against the version that sampled it, before any update
                pairs = zip(samples, first_forward, strict=True)
                under = [with_current(sampled[i], lp, versions[i], step) for i, lp in pairs]
                checks.append(gate.rollout_vs_sampling_version(ref, under, _masks(batch, samples)))
            else:
                check = gate.recompute_vs_first_forward if recompute else gate.rollout_vs_first_forward
                checks.append(check(ref, first_forward, _masks(batch, samples)))
            checked.extend(samples)
            seen.extend(first_forward)
            return checks[0].passed

        if stale_ok:  # decoupled PPO: keep this version's weights for samples still in flight, then update
            loop.snapshots.keep(step)
        metrics = worker.ppo_step(
            batch.prompts,
            batch.responses,
            # asynchronous: the proximal policy's (None: the first training forward's), the rollout's the
            # behaviour policy's
            old_logprobs=None if stale_ok and not recompute else old,
            rollout_logprobs=batch.rollout_logprobs,
            advantages=batch.advantages,
            loss_masks=batch.response_masks,  # a multi-turn task's: the environment's tokens carry no loss
            may_update=may_update,
            record_routes=cfg.model.is_moe and not recompute,
            behaviour_logprobs=batch.rollout_logprobs if stale_ok else None,
            tis_cap=cfg.trainer.tis_cap,
        )
        verdict = checks[0]
        metrics.update(
            first_forward_mismatched=verdict.report.mismatched_tokens,
            first_forward_max_abs_diff=verdict.report.max_abs_logprob_diff,
        )
        if not recompute:  # the trainer's logprobs of the checked samples are their first forward's
            trained, rolled = model_tokens(seen, [old[i] for i in checked], _masks(batch, checked))
            metrics.update(train_rollout_metrics(torch.cat(trained), torch.cat(rolled)))
        if stale_ok:
            metrics.update(
                async_metrics(
                    versions, step, old if recompute else [lp.detach() for lp in seen], batch.rollout_logprobs,
                    dict(zip(checked, seen, strict=True)), cfg.trainer.tis_cap, batch.response_masks,
                ),
                max_staleness=stale_ok,
                trainer_policy_version=step,  # the weights this step trains (the samples' may be older)
                kept_versions=sorted(loop.snapshots.kept),
            )  # fmt: skip
        # 5. export the new weights (every rank takes part)
        if verdict.passed:
            loop.weights.export(worker, step)
    assert verdict is not None
    if loop.rank0:
        # 6. the step record and samples
        parity = (first or verdict).report
        routing: dict[str, float | None] = {}
        if cfg.model.is_moe:  # null when the server gave no routes; absent for a dense model
            routed = range(len(batch.prompts)) if recompute else checked
            routing["routing_agreement"] = _routing_agreement(cfg, batch, worker.last_routes, list(routed))
        record = {
            "step": step,
            **parity.to_dict(),
            **routing,
            **metrics,
            "recompute": recompute,
            # samples whose rollout logprobs the gate compared with the trainer's, bit for bit
            "gate_samples": len(batch.prompts) if recompute else len(checked),
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
            "rollout_s": round(t_rollout, 3),  # asynchronous: the wait for the producer's batch and its broadcast
            **({"rollout_wait_s": round(waited, 3)} if waited is not None else {}),
            "step_s": round(time.monotonic() - t0, 3),
            "time": round(time.time(), 3),  # when the record was written (unix seconds): steps end to end
        }
        # the trainer's logprobs the gate compared: the recompute's, else the first training forward's
        trained = old if recompute else by_sample(len(batch.prompts), checked, seen)
        loop.records.write(record, batch, trained)
        log.info(
            f"step {step}: tokens={parity.tokens_scored} mismatched={parity.mismatched_tokens} "
            f"max|Δ|={parity.max_abs_logprob_diff:.3e} grad_norm={metrics.get('grad_norm')}"
            + (f" routing_agreement={routing['routing_agreement']}" if routing else "")
        )
        # 7. the server loads the new weights (asynchronous: and the producer may start the batches it allows)
        if verdict.passed:
            loop.weights.push(step)
            if loop.producer is not None:
                loop.producer.pushed(policy_version(loop.weights.version) or 0)
    return verdict


def _masks(batch: Batch, samples: list[int]) -> list[torch.Tensor] | None:
    """The model-token masks of `samples` (a multi-turn task's), None when every token is the model's."""
    return None if batch.response_masks is None else [batch.response_masks[i] for i in samples]


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
