"""What rank 0 writes each step and at the end: the step record (metrics.jsonl), the samples
(samples.jsonl, text when the checkpoint has a tokenizer), both to the metrics logger (W&B), and the
trainer's verdict (STATUS_FILE) for the launcher.

Each record is one line appended and fsynced, so a crash later never loses a completed step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tonpolicy.cpu_memory import tree_peak_rss_mib
from tonpolicy.files import write_json_atomic
from tonpolicy.loop.exit_codes import STATUS_FILE
from tonpolicy.loop.rollout_batch import Batch
from tonpolicy.loop.weight_sync import policy_version, sampled_versions
from tonpolicy.rl.multi_turn import segments


class MetricsLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def log_samples(self, samples: dict[str, Any]) -> None: ...
    def finish(self, exit_code: int) -> None: ...


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_status(run_dir: Path, code: int, message: str) -> None:
    write_json_atomic(run_dir / STATUS_FILE, {"code": code, "message": message})


def due(step: int, every: int) -> bool:
    """Whether `step` is one of every `every` steps (0: none)."""
    return every > 0 and step % every == 0


def peak_memory() -> dict[str, float]:
    """This process's peak resident memory and, on a GPU, the most CUDA memory torch allocated (MiB)."""
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20 if sys.platform == "darwin" else 1 << 10)
    out = {"peak_rss_mib": round(rss, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / (1 << 20), 1)
    return out


def rollout_peak_memory(run_dir: Path) -> dict[str, float]:
    """The rollout servers' peak resident memory (MiB), beside the trainer's: each server's process tree
    (the launcher's pids.json names them; a fleet's largest member), on this node's /proc. Nothing where
    the launcher wrote no pids (a trainer started by hand) or the servers run elsewhere."""
    try:
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    servers = [pid for name, pid in pids.items() if name.startswith("rollout") and name != "rollout-router"]
    peaks = [p for p in map(tree_peak_rss_mib, servers) if p is not None]
    return {"peak_rollout_rss_mib": max(peaks)} if peaks else {}


def throughput(record: dict[str, Any], batch: Batch) -> dict[str, float]:
    """Tokens per second: the rollout's sampled tokens over its time, the trainer's tokens (prompt and
    response) over the rest of the step."""
    out: dict[str, float] = {}
    sampled = sum(len(r) for r in batch.responses)
    rollout_s, step_s = record.get("rollout_s"), record.get("step_s")
    if rollout_s:
        out["rollout_tokens_per_s"] = round(sampled / rollout_s, 1)
    if rollout_s is not None and step_s is not None and step_s > rollout_s:
        trained = sampled + sum(len(p) for p in batch.prompts)
        out["train_tokens_per_s"] = round(trained / (step_s - rollout_s), 1)
    return out


def by_sample(n: int, samples: list[int], logprobs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """`logprobs` of `samples` placed at their index among `n` (None where a sample has none)."""
    out: list[torch.Tensor | None] = [None] * n
    for i, lp in zip(samples, logprobs, strict=True):
        out[i] = lp
    return out


class StepRecords:
    """`tokenizer`: None for a checkpoint without one (the samples hold token ids only).
    `samples_every`: the samples of every N-th step also hold per-token logprobs (0: never)."""

    def __init__(self, run_dir: Path, logger: MetricsLogger, tokenizer: Any, samples_every: int = 1) -> None:
        self.run_dir, self.logger, self.tokenizer = run_dir, logger, tokenizer
        self.samples_every = samples_every

    def write(
        self,
        record: dict[str, Any],
        batch: Batch,
        trainer_logprobs: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """`trainer_logprobs`: per sample, the trainer's logprobs the gate compared (None: not compared)."""
        record = {**record, **throughput(record, batch), **peak_memory(), **rollout_peak_memory(self.run_dir)}
        if batch.weight_versions is not None:  # tokens per weight version that sampled them
            counts = Counter(sampled_versions(batch.weight_versions, batch.response_masks))
            numbers = [policy_version(v) for v in counts]
            record = {
                **record,
                "weight_versions": dict(counts),
                "policy_version": max((n for n in numbers if n is not None), default=None),
            }
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        samples: dict[str, Any] = {
            "step": record["step"],
            "prompts": batch.prompts,
            "responses": batch.responses,
            "rewards": batch.rewards,
        }
        if due(record["step"], self.samples_every):  # per token, what a parity user inspects
            samples["rollout_logprobs"] = [lp.float().tolist() for lp in batch.rollout_logprobs]
            if trainer_logprobs is not None:
                samples["trainer_logprobs"] = [
                    None if lp is None else lp.detach().float().tolist() for lp in trainer_logprobs
                ]
        if batch.weight_versions is not None:  # per sample, the version that sampled each response token
            samples["weight_versions"] = batch.weight_versions
        if self.tokenizer is not None:
            decode = self.tokenizer.decode
            samples["prompt_texts"] = [decode(p, skip_special_tokens=False) for p in batch.prompts]
            samples["response_texts"] = [decode(r, skip_special_tokens=False) for r in batch.responses]
        if batch.response_masks is not None:  # a multi-turn task's: who said what (env tokens carry no loss)
            samples["turns"] = [
                [
                    {"who": who, "ids": ids, "trained": who == "model"}
                    | ({"text": self.tokenizer.decode(ids, skip_special_tokens=False)} if self.tokenizer else {})
                    for who, ids in segments(r, m.tolist())
                ]
                for r, m in zip(batch.responses, batch.response_masks, strict=True)
            ]
        append_jsonl(self.run_dir / "samples.jsonl", samples)
        self.logger.log(record)
        self.logger.log_samples(samples)

    def finish(self, code: int, message: str) -> None:
        self.logger.finish(code)
        write_status(self.run_dir, code, message if code else "ok")
