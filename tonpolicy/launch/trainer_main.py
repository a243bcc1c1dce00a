"""Trainer ranks' entry point (`torchrun -m tonpolicy.launch.trainer_main --config ...`).

Rank 0 drives the rollout server and broadcasts the samples; every rank recomputes logprobs at the
configured layout and takes the PPO/GRPO step. Rank 0 runs the exact-zero gate, writes the step
record, logs to W&B and syncs the new weights to the server.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tonpolicy.config.compose import load_config
from tonpolicy.config.schema import Config
from tonpolicy.contract.gate import compare_logprobs
from tonpolicy.contract.handshake import handshake
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.files import write_json_atomic
from tonpolicy.launch.faults import injected_fault, with_fault_advantages
from tonpolicy.launch.records import (
    EXIT_GATE_FAILED,
    EXIT_HANDSHAKE,
    STATUS_FILE,
    append_jsonl,
)
from tonpolicy.model.tokenizer import load_tokenizer
from tonpolicy.rl.batch import collect_batch


def broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _weight_pusher(cfg: Config, client: Any) -> Any:
    """Rank 0's weight-update group with the server's engine ranks (rollout.weight_sync=distributed)."""
    from tonpolicy.launch.plan import resolve_device
    from tonpolicy.launch.weight_push import WeightPusher

    engine_ranks = cfg.parallel.rollout_tp if cfg.rollout.backend == "sglang" else 1
    backend = cfg.rollout.weight_sync_backend or ("nccl" if resolve_device(cfg) == "cuda" else "gloo")
    # The group meets at rank 0's node (node 0): engine ranks on other nodes must reach it there.
    return WeightPusher(
        client,
        engine_ranks,
        backend,
        cfg.trainer.timeout_s,
        address=cfg.trainer.master_addr,
        bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--server-url", required=True)
    ap.add_argument("--checkpoint", required=True)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    run_dir = Path(args.run_dir)

    from tonpolicy.launch.plan import resolve_device
    from tonpolicy.trainer.worker import TrainerWorker

    if resolve_device(cfg) == "cpu":  # this node's CPU (another node's may differ from the launcher's)
        from tonpolicy.contract.host import host_problems

        problems = host_problems(cfg.model, cfg.contract)
        if problems:
            print("tonpolicy trainer: " + "\n".join(problems), file=sys.stderr, flush=True)
            return 2
    worker = TrainerWorker(cfg, args.checkpoint)
    rank0 = dist.get_rank() == 0
    client = logger = None
    if rank0:
        from tonpolicy.launch.wandb_log import MetricsLogger
        from tonpolicy.rollout.client import RolloutClient

        client = RolloutClient(args.server_url)
        client.wait_healthy(cfg.rollout.health_timeout_s)  # launch.sh starts both at once
        ours_runtime = runtime_identity(worker.kernel_set, cfg.contract.dtype, resolve_device(cfg))
        refusal = handshake(cfg, client, ours_runtime)
        tokenizer = load_tokenizer(args.checkpoint)  # None for a checkpoint without one: ids only
        logger = MetricsLogger(cfg, run_dir, group=run_dir.parent.name)
    refusal = broadcast(refusal if rank0 else None)
    if refusal:
        if rank0:
            print(f"tonpolicy: refusing to train: {refusal}", file=sys.stderr)
            write_json_atomic(run_dir / STATUS_FILE, {"code": EXIT_HANDSHAKE, "message": refusal})
        worker.close()
        return EXIT_HANDSHAKE

    pusher = _weight_pusher(cfg, client) if rank0 and cfg.rollout.weight_sync == "distributed" else None
    fail_on_mismatch = cfg.gate.fail_on_mismatch
    if fail_on_mismatch is None:
        fail_on_mismatch = cfg.contract.exact_zero
    code, message = 0, ""
    for step in range(cfg.experiment.steps):
        t0 = time.monotonic()
        injected_fault(step)
        batch = broadcast(with_fault_advantages(collect_batch(cfg, client, step)) if rank0 else None)
        t_rollout = time.monotonic() - t0
        trainer_logprobs = worker.logprobs(batch["prompts"], batch["responses"])
        parity = compare_logprobs(batch["rollout_logprobs"], trainer_logprobs) if rank0 else None
        # The gate runs before the update: a step that breaks the contract trains nothing. Two checks:
        # rollout == recompute (here), recompute == first training forward (inside ppo_step).
        gate_failed = broadcast(bool(rank0 and fail_on_mismatch and not parity.exact))
        failed_check = "rollout_vs_recompute" if gate_failed else None
        metrics: dict[str, Any] = {}
        if not gate_failed:
            metrics = worker.ppo_step(
                batch["prompts"],
                batch["responses"],
                old_logprobs=trainer_logprobs,
                rollout_logprobs=batch["rollout_logprobs"],
                advantages=batch["advantages"],
                exact_first_forward=fail_on_mismatch,
            )
            if fail_on_mismatch and metrics["first_forward_mismatched"]:  # identical on every rank
                gate_failed, failed_check = True, "recompute_vs_first_training_forward"
            elif cfg.rollout.weight_sync == "disk":
                ckpt = run_dir / "checkpoints" / f"step_{step + 1}"
                worker.save_hf(ckpt)
            else:
                new_weights = worker.hf_state_dict()  # on rank 0; every rank takes part in the gather
        if rank0:
            record = {
                "step": step,
                **parity.to_dict(),
                **metrics,
                "gate": "failed" if gate_failed else "passed",
                "gate_check": failed_check,
                "reward_mean": sum(batch["rewards"]) / len(batch["rewards"]),
                "rollout_s": round(t_rollout, 3),
                "step_s": round(time.monotonic() - t0, 3),
            }
            append_jsonl(run_dir / "metrics.jsonl", record)
            samples = {
                "step": step,
                "prompts": batch["prompts"],
                "responses": batch["responses"],
                "rewards": batch["rewards"],
            }
            if tokenizer is not None:
                samples["prompt_texts"] = [tokenizer.decode(p, skip_special_tokens=False) for p in batch["prompts"]]
                samples["response_texts"] = [tokenizer.decode(r, skip_special_tokens=False) for r in batch["responses"]]
            append_jsonl(run_dir / "samples.jsonl", samples)
            logger.log(record)
            logger.log_samples(samples)
            print(
                f"step {step}: tokens={parity.tokens_scored} mismatched={parity.mismatched_tokens} "
                f"max|Δ|={parity.max_abs_logprob_diff:.3e} grad_norm={metrics.get('grad_norm')}",
                flush=True,
            )
            if not gate_failed and pusher is not None:
                pusher.push(new_weights, weight_version=f"step_{step + 1}")
            elif not gate_failed:
                client.update_weights_from_disk(str(ckpt), weight_version=f"step_{step + 1}")
        if gate_failed:
            code = EXIT_GATE_FAILED
            if rank0:
                if failed_check == "rollout_vs_recompute":
                    what = (
                        f"{parity.mismatched_tokens} of {parity.tokens_scored} tokens differ between rollout "
                        f"and trainer recompute (max |Δlogprob| {parity.max_abs_logprob_diff:.3e})"
                    )
                else:
                    what = (
                        f"{metrics['first_forward_mismatched']} tokens differ between the trainer's recompute "
                        f"and its first training forward (max |Δlogprob| "
                        f"{metrics['first_forward_max_abs_diff']:.3e})"
                    )
                message = (
                    f"parity gate failed at step {step}: {what}; contract {cfg.contract.name}, "
                    f"gate.fail_on_mismatch={fail_on_mismatch}; no update was made"
                )
            break
    if pusher is not None:
        pusher.close()
    if rank0:
        logger.finish(code)
        write_json_atomic(run_dir / STATUS_FILE, {"code": code, "message": message if code else "ok"})
    worker.close()
    return code  # non-zero fails a hand-run launch.sh too; the launcher reads the status file


if __name__ == "__main__":
    sys.exit(main())
