"""What rank 0 records per step beyond the trainer's metrics: tokens per second, peak memory, and (every
logger.samples_every steps) the rollout's and the trainer's per-token logprobs in samples.jsonl."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from tests.support.list_logger import Logger
from tonpolicy.loop.records import StepRecords, by_sample, due
from tonpolicy.loop.rollout_batch import Batch


def _batch() -> Batch:
    lp = [torch.tensor([-0.5, -1.25, -3.0e-8], dtype=torch.float32), torch.tensor([-2.0], dtype=torch.float32)]
    return Batch(
        prompts=[[1, 2], [3]],
        seeds=[0, 1],
        responses=[[4, 5, 6], [7]],
        rollout_logprobs=lp,
        rewards=[1.0, 0.0],
        advantages=[0.5, -0.5],
    )


def _bits(values: list[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def test_records_carry_throughput_and_peak_memory(tmp_path: Path) -> None:
    logger = Logger()
    StepRecords(tmp_path, logger, None).write({"step": 0, "rollout_s": 0.5, "step_s": 2.5}, _batch())
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["rollout_tokens_per_s"] == 8.0  # 4 sampled tokens in 0.5 s
    assert record["train_tokens_per_s"] == 3.5  # 4 + 3 prompt tokens in the other 2 s
    assert record["peak_rss_mib"] > 0 and logger.records == [record]


def test_per_token_logprobs_every_n_steps_bit_for_bit(tmp_path: Path) -> None:
    batch = _batch()
    trainer = by_sample(2, [1], [torch.tensor([-2.0])])  # sample 0 not compared
    records = StepRecords(tmp_path, Logger(), None, samples_every=2)
    for step in range(3):
        records.write({"step": step}, batch, trainer)
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert ["rollout_logprobs" in s for s in samples] == [True, False, True]
    assert _bits(samples[0]["rollout_logprobs"][0]) == _bits(batch.rollout_logprobs[0].tolist())
    assert samples[0]["trainer_logprobs"] == [None, [-2.0]]
    assert [due(s, 0) for s in range(3)] == [False] * 3
