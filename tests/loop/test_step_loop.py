"""`take_step` in one process (a gloo group of one) with a stand-in worker and server: a passing step
trains, exports and pushes the weights; a failing check of any kind trains nothing, exports and
pushes nothing, and its record names the check. With trainer.recompute_logprobs (off_policy's default)
the gate checks rollout == recompute, then recompute == first training forward; without it (an exact
contract's default) there is no recompute and the one check is rollout == first training forward."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.list_logger import Logger

from tonpolicy.config.schema import Config, ExperimentConfig, TrainerConfig
from tonpolicy.loop.gate_policy import Gate
from tonpolicy.loop.records import StepRecords, append_jsonl
from tonpolicy.loop.run import Loop, take_step
from tonpolicy.loop.weight_sync import DiskWeightSync
from tonpolicy.ports import free_port
from tonpolicy.rl.train_samples import TrainSamples


def _lps(response: list[int]) -> list[float]:
    return [-0.25 - 0.01 * t for t in response]


class Server:
    """Answers /generate with fixed samples; records the weight loads it is asked for; `retried`: the
    re-sent requests its client would report."""

    def __init__(self, flip: bool = False, retried: int = 0) -> None:
        self.flip, self.loaded, self.version, self.retried = flip, [], "default", retried

    def take_retries(self) -> int:
        n, self.retried = self.retried, 0
        return n

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[dict]:
        outs = [
            {
                "output_ids": [3 + i % 2, 4],
                "output_logprobs": _lps([3 + i % 2, 4]),
                "weight_versions": [self.version] * 2,
            }
            for i in range(len(prompts))
        ]
        if self.flip:  # one token's logprob one ulp away
            outs[0]["output_logprobs"][0] = float(
                torch.nextafter(torch.tensor(outs[0]["output_logprobs"][0]), torch.tensor(0.0))
            )
        return outs

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        self.loaded.append((Path(path).name, weight_version))
        self.version = weight_version


class Worker:
    """The trainer's recompute and training forward reproduce `_lps`; `first_forward_off` makes the
    training forward differ. `minibatches`: ppo_step's first forward covers the first 1/minibatches."""

    def __init__(self, first_forward_off: bool = False, minibatches: int = 1) -> None:
        self.first_forward_off, self.minibatches, self.updates, self.saved = first_forward_off, minibatches, 0, []
        self.recomputes = 0
        self.old: list[torch.Tensor] = []

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        self.recomputes += 1
        return [torch.tensor(_lps(r), dtype=torch.float32) for r in responses]

    def ppo_step(self, train: TrainSamples, may_update: Any, record_routes: bool = False) -> dict:
        assert train.old_logprobs is not None
        self.old = train.old_logprobs
        samples = list(range(len(train) // self.minibatches))
        first = [torch.tensor(_lps(train.responses[i]), dtype=torch.float32) for i in samples]
        if self.first_forward_off:
            first[1].view(torch.int32)[0] ^= 1
        ok = may_update(samples, first)
        self.updates += ok
        return {"clipfrac": 0.0, "grad_norm": 1.5 if ok else float("nan"), "update_successful": float(ok), "lr": 1e-3}

    def save_hf(self, path: Path) -> None:
        self.saved.append(path.name)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _step(tmp_path: Path, server: Server, worker: Worker, recompute: bool | None = True) -> tuple[Any, dict]:
    cfg = Config(
        experiment=ExperimentConfig(prompts_per_step=2, samples_per_prompt=2),
        trainer=TrainerConfig(recompute_logprobs=recompute),
    )
    logger = Logger()
    loop = Loop(
        cfg, worker, Gate(0, "c"), DiskWeightSync(server, tmp_path), True, server, StepRecords(tmp_path, logger, None)
    )
    verdict = take_step(loop, 0)
    assert len(logger.records) == 1 and (tmp_path / "metrics.jsonl").exists()
    return verdict, logger.records[0]


def test_a_passing_step_trains_and_syncs(tmp_path: Path) -> None:
    server, worker = Server(), Worker()
    verdict, record = _step(tmp_path, server, worker)
    assert verdict.passed and record["gate"] == "passed" and record["gate_check"] is None
    assert record["mismatched_tokens"] == 0 and record["first_forward_mismatched"] == 0
    assert worker.updates == 1 and worker.saved == ["step_1"] and server.loaded == [("step_1", "step_1")]
    assert record["rollout_retries"] == 0


def test_the_record_counts_the_rollout_requests_re_sent(tmp_path: Path) -> None:
    verdict, record = _step(tmp_path, Server(retried=2), Worker())
    assert verdict.passed and record["rollout_retries"] == 2


def test_a_rollout_mismatch_trains_nothing(tmp_path: Path) -> None:
    server, worker = Server(flip=True), Worker()
    verdict, record = _step(tmp_path, server, worker)
    assert verdict.failed and record["gate"] == "failed" and record["gate_check"] == "rollout_vs_recompute"
    assert record["mismatched_tokens"] == 1 and "grad_norm" not in record and "first_forward_mismatched" not in record
    assert worker.updates == 0 and worker.saved == [] and server.loaded == []


def test_a_first_forward_mismatch_trains_nothing(tmp_path: Path) -> None:
    server, worker = Server(), Worker(first_forward_off=True)
    verdict, record = _step(tmp_path, server, worker)
    assert verdict.failed and record["gate_check"] == "recompute_vs_first_training_forward"
    assert record["mismatched_tokens"] == 0 and record["first_forward_mismatched"] == 1
    assert record["update_successful"] == 0.0
    assert worker.updates == 0 and worker.saved == [] and server.loaded == []


def test_the_default_exact_job_gates_the_first_training_forward_without_a_recompute(tmp_path: Path) -> None:
    """trainer.recompute_logprobs=null under an exact contract: no recompute, PPO's old logprobs are the
    rollout's, and the gate compared every sample's first training forward with them."""
    server, worker = Server(), Worker()
    verdict, record = _step(tmp_path, server, worker, recompute=None)
    assert verdict.passed and record["gate_check"] is None and record["recompute"] is False
    assert worker.recomputes == 0 and worker.updates == 1 and server.loaded == [("step_1", "step_1")]
    assert record["tokens_scored"] == 8 and record["mismatched_tokens"] == 0 and record["gate_samples"] == 4
    assert record["train_rollout_logprob_abs_diff"] == 0.0  # the first forward's, not old == rollout's
    assert all(torch.equal(o, torch.tensor(_lps(r))) for o, r in zip(worker.old, [[3, 4], [4, 4]] * 2, strict=True))


def test_a_planted_rollout_mismatch_without_the_recompute_trains_nothing(tmp_path: Path) -> None:
    server, worker = Server(flip=True), Worker()
    verdict, record = _step(tmp_path, server, worker, recompute=False)
    assert verdict.failed and record["gate"] == "failed"
    assert record["gate_check"] == "rollout_vs_first_training_forward" and record["recompute"] is False
    assert record["mismatched_tokens"] == 1 and record["first_forward_mismatched"] == 1
    assert record["update_successful"] == 0.0 and record["train_rollout_logprob_max_abs_diff"] > 0
    assert worker.recomputes == 0 and worker.updates == 0 and worker.saved == [] and server.loaded == []


def test_with_minibatches_the_gate_checks_the_samples_before_any_update(tmp_path: Path) -> None:
    """ppo_minibatches=2: only the first minibatch's first forward precedes every update; the record
    says how many samples the gate compared."""
    verdict, record = _step(tmp_path, Server(), Worker(minibatches=2), recompute=False)
    assert verdict.passed and record["gate_samples"] == 2 and record["tokens_scored"] == 4
    (tmp_path / "r").mkdir()
    verdict, record = _step(tmp_path / "r", Server(), Worker(minibatches=2), recompute=True)
    assert verdict.passed and record["gate_samples"] == 4 and record["tokens_scored"] == 8


def test_records_append_whole_lines(tmp_path: Path) -> None:
    append_jsonl(tmp_path / "m.jsonl", {"step": 0})
    append_jsonl(tmp_path / "m.jsonl", {"step": 1})
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
