"""What rank 0 writes each step and at the end: the step record (metrics.jsonl), the samples
(samples.jsonl, text when the checkpoint has a tokenizer), both to the metrics logger (W&B), and the
trainer's verdict (STATUS_FILE) for the launcher.

Each record is one line appended and fsynced, so a crash later never loses a completed step.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from tonpolicy.files import write_json_atomic
from tonpolicy.loop.batch import Batch
from tonpolicy.loop.exit_codes import STATUS_FILE
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


class StepRecords:
    """`tokenizer`: None for a checkpoint without one (the samples hold token ids only)."""

    def __init__(self, run_dir: Path, logger: MetricsLogger, tokenizer: Any) -> None:
        self.run_dir, self.logger, self.tokenizer = run_dir, logger, tokenizer

    def write(self, record: dict[str, Any], batch: Batch) -> None:
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
