"""Asynchronous steps (experiment.max_staleness), in one process: the producer starts batch j only once
version j - k is served and hands batches over in order (errors too); the version check allows at most k
versions of staleness; each token is compared with the trainer's logprob under the version that sampled
it; decoupled PPO's importance weights; and the whole step loop over a stand-in server whose versions
lag one push behind, with a stand-in worker whose logprobs depend on its weights' version."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.list_logger import Logger

from tonpolicy.config.compose import compose_config
from tonpolicy.config.schema import Config, ExperimentConfig, TrainerConfig
from tonpolicy.loop.gate_policy import Gate
from tonpolicy.loop.producer import BatchProducer
from tonpolicy.loop.records import StepRecords
from tonpolicy.loop.run import Loop, make_batch, take_step
from tonpolicy.loop.staleness import (
    async_metrics,
    logprobs_under_sampling_versions,
    staleness_histogram,
    token_versions,
)
from tonpolicy.loop.weight_sync import DiskWeightSync, PolicyVersionError, policy_version
from tonpolicy.ports import free_port
from tonpolicy.rl.objective import PPOConfig, importance_weights, mean_loss
from tonpolicy.rl.train_samples import TrainSamples
from tonpolicy.validation.validate import ConfigError, validate


def test_the_producer_waits_for_the_version_each_batch_allows() -> None:
    started: list[tuple[int, float]] = []

    def make(j: int) -> int:
        started.append((j, time.monotonic()))
        return 10 * j

    producer = BatchProducer(make, steps=4, max_staleness=1)
    assert producer.take(0)[0] == 0 and producer.take(1)[0] == 10  # versions 0 allows batches 0 and 1
    time.sleep(0.2)
    assert [j for j, _ in started] == [0, 1]  # batch 2 needs version 1
    t_push = time.monotonic()
    producer.pushed(1)
    assert producer.take(2)[0] == 20 and started[2][1] >= t_push
    assert producer.started == {0: 0, 1: 0, 2: 1}
    producer.pushed(3)
    assert producer.take(3)[0] == 30
    producer.close()


def test_the_producer_hands_its_error_to_the_trainer_and_stops() -> None:
    def make(j: int) -> int:
        if j == 1:
            raise ConnectionError("the server is gone")
        return j

    producer = BatchProducer(make, steps=3, max_staleness=2)
    assert producer.take(0)[0] == 0
    with pytest.raises(ConnectionError, match="gone"):
        producer.take(1)
    producer.close()
    stopped = BatchProducer(lambda j: j, steps=5, max_staleness=1)
    stopped.close()  # waits for nothing: the thread sleeps on the version
    assert not stopped._thread.is_alive()
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        BatchProducer(lambda j: j, steps=1, max_staleness=0)


def test_the_version_check_allows_at_most_k_versions_of_staleness() -> None:
    class Client:
        def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict:
            return {"success": True}

    sync = DiskWeightSync(Client(), Path("/nonexistent"))
    sync.push(0)
    sync.push(1)  # the servers serve step_2 (version 2)
    sync.check_versions([["step_1", "step_2"]], max_staleness=1)
    with pytest.raises(PolicyVersionError, match=r"\{'default': 1\}.*policy versions 1..2.*too stale"):
        sync.check_versions([["default", "step_2"]], max_staleness=1)
    with pytest.raises(PolicyVersionError, match="expected every token from 'step_2'"):
        sync.check_versions([["step_1"]])
    sync.check_versions([["default"], ["step_1", "step_2"]], max_staleness=2)


def test_each_token_is_compared_under_the_version_that_sampled_it() -> None:
    versions = token_versions([["step_1", "step_1", "step_2"], ["step_2"]])
    assert versions == [[1, 1, 2], [2]] and staleness_histogram(versions, 2) == {"0": 2, "1": 2}

    class Snapshots:
        def __init__(self) -> None:
            self.asked: list[tuple[int, int]] = []

        def logprobs_under(self, v: int, prompts: list, responses: list) -> list[torch.Tensor]:
            self.asked.append((v, len(responses)))
            return [torch.full((len(r),), -float(v)) for r in responses]

    snaps = Snapshots()
    proximal = [torch.full((3,), -2.0), torch.full((1,), -2.0)]
    out = logprobs_under_sampling_versions(snaps, [[1], [1]], [[5, 6, 7], [8]], versions, 2, proximal)
    assert snaps.asked == [(1, 1)]  # only version 1's samples are forwarded again, under version 1
    assert out[0].tolist() == [-1.0, -1.0, -2.0] and out[1].tolist() == [-2.0]
    assert proximal[0].tolist() == [-2.0] * 3  # the proximal logprobs are left as they are

    rollout = [torch.tensor([-1.0, -1.0, -2.0]), torch.tensor([-2.0])]
    m = async_metrics(versions, 2, proximal, rollout, {0: proximal[0], 1: proximal[1]}, 1.5, None)
    assert m["staleness"] == {"0": 2, "1": 2}
    assert m["first_forward_ratio_current_min"] == m["first_forward_ratio_current_max"] == 1.0
    stale_w = torch.exp(torch.tensor(-1.0)).item()  # the stale tokens' proximal is 1 below their behaviour
    assert m["is_ratio_max"] == 1.0 and m["is_ratio_mean"] == pytest.approx((2 * stale_w + 2) / 4)
    assert m["tis_truncated_frac"] == 0.0


def test_decoupled_ppo_weighs_each_token_by_the_truncated_importance_ratio() -> None:
    proximal, behaviour = [torch.tensor([-1.0, -3.0])], [torch.tensor([-2.0, -1.0])]
    w = importance_weights(proximal, behaviour, cap=2.0)[0]
    assert w.tolist() == [2.0, pytest.approx(torch.exp(torch.tensor(-2.0)).item())]  # e^1 truncated at 2
    lp, adv, mask = [torch.tensor([-1.0, -3.0])], [torch.tensor([1.0, 1.0])], [torch.ones(2)]
    # ratio 1 at the first forward: each token's loss is -A, weighted
    assert mean_loss(lp, proximal, adv, mask, PPOConfig(), [w]) == pytest.approx(-float(w.sum()) / 2)
    assert mean_loss(lp, proximal, adv, mask, PPOConfig()) == -1.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["experiment.max_staleness=-1"], "experiment.max_staleness=-1: must be >= 0"),
        (["experiment.max_staleness=1", "task=calculator"], "task calculator is multi-turn"),
        (["experiment.max_staleness=1", "model=qwen3_moe_tiny", "contract=qwen3_moe_v2"], "MoE model's routes"),
        (["experiment.max_staleness=1", "trainer.recompute_logprobs=false"], "trainer.recompute_logprobs=False"),
        (["trainer.tis_cap=0.5"], "trainer.tis_cap=0.5: must be a finite number >= 1"),
    ],
)
def test_what_asynchronous_steps_refuse(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        validate(compose_config(overrides), check_hf=False)


def test_asynchronous_defaults_are_valid() -> None:
    cfg = compose_config(["experiment.max_staleness=2", "trainer.tis_cap=2.0"])
    validate(cfg, check_hf=False)
    assert compose_config([]).experiment.max_staleness == 0 and compose_config([]).trainer.tis_cap is None


# --- the step loop over stand-ins -----------------------------------------------------------------


def _lps(response: list[int], version: int) -> list[float]:
    return [-0.25 - 0.01 * t - 0.125 * version for t in response]


class Server:
    """Samples under the weights it serves (their version), answers weight loads; thread-safe enough for
    one producer thread and the main thread."""

    def __init__(self, stale_label: bool = False) -> None:
        self.version, self.loaded, self.lock = "default", [], threading.Lock()
        self.stale_label = stale_label  # the negative control: labels version v >= 1's tokens v + 1

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[dict]:
        with self.lock:
            v = policy_version(self.version)
            label = f"step_{v + 1}" if self.stale_label and v else self.version
        return [
            {"output_ids": [3 + i % 2, 4], "output_logprobs": _lps([3 + i % 2, 4], v), "weight_versions": [label] * 2}
            for i in range(len(prompts))
        ]

    def take_retries(self) -> int:
        return 0

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        with self.lock:
            self.loaded.append(weight_version)
            self.version = weight_version


class Worker:
    """Its logprobs are those of its weights' version (the number of updates, or a kept version's)."""

    def __init__(self, minibatches: int = 1) -> None:
        self.version, self.saved, self.minibatches, self.recomputes = 0, [], minibatches, 0

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
        self.recomputes += 1
        return [torch.tensor(_lps(r, self.version), dtype=torch.float32) for r in responses]

    def ppo_step(self, train: TrainSamples, may_update: Any, record_routes: bool = False) -> dict:
        self.behaviour, self.old = train.behaviour_logprobs, train.old_logprobs
        first = list(range(len(train) // self.minibatches))  # the first minibatch's samples
        ok = may_update(first, [torch.tensor(_lps(train.responses[i], self.version)) for i in first])
        self.version += ok
        return {"grad_norm": 1.0, "update_successful": float(ok)}

    def save_hf(self, path: Path) -> None:
        self.saved.append(path.name)


class Snapshots:
    def __init__(self, worker: Worker) -> None:
        self.worker, self.kept = worker, {}

    def keep(self, version: int) -> None:
        self.kept = {v: v for v in self.kept if v >= version} | {version: version}

    def logprobs_under(self, v: int, prompts: list, responses: list) -> list[torch.Tensor]:
        current, self.worker.version = self.worker.version, self.kept[v]
        try:
            return self.worker.logprobs(prompts, responses)
        finally:
            self.worker.version = current


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(tmp_path: Path, server: Server, steps: int = 4, minibatches: int = 1) -> tuple[list[dict], Worker]:
    cfg = Config(
        experiment=ExperimentConfig(prompts_per_step=2, samples_per_prompt=2, steps=steps, max_staleness=1),
        trainer=TrainerConfig(tis_cap=2.0, ppo_minibatches=minibatches),
    )
    worker, logger = Worker(minibatches), Logger()
    loop = Loop(
        cfg, worker, Gate(0, "c"), DiskWeightSync(server, tmp_path), True, server, StepRecords(tmp_path, logger, None)
    )
    loop.snapshots = Snapshots(worker)
    loop.producer = BatchProducer(lambda j: make_batch(loop, j), steps, 1)
    try:
        for step in range(steps):
            if take_step(loop, step).failed:
                break
    finally:
        loop.producer.close()
    return logger.records, worker


def test_asynchronous_steps_train_one_version_stale_with_exact_behaviour_logprobs(
    tmp_path: Path, one_rank_group: None
) -> None:
    server = Server()
    records, worker = _run(tmp_path, server)
    assert [r["gate"] for r in records] == ["passed"] * 4 and worker.version == 4
    assert [r["mismatched_tokens"] for r in records] == [0] * 4
    assert [r["trainer_policy_version"] for r in records] == [0, 1, 2, 3]
    # batch j starts once version j - 1 is served: batch 1 is sampled by version 0 while step 0 trains
    assert [r["policy_version"] for r in records] == [0, 0, 1, 2]
    assert [r["staleness"] for r in records] == [{"0": 8}] + [{"1": 8}] * 3
    assert records[0]["first_forward_ratio_current_max"] == 1.0 and records[0]["is_ratio_mean"] == 1.0
    # one version newer: the current policy gives each token 0.125 less, the weights e^-0.125
    assert records[1]["is_ratio_mean"] == pytest.approx(torch.exp(torch.tensor(-0.125)).item())
    # one update per step: the proximal logprobs are the first training forward's (no extra forward)
    assert worker.old is None and worker.behaviour is not None and worker.recomputes == 3  # steps 1-3: version j-1 only
    assert server.loaded == ["step_1", "step_2", "step_3", "step_4"]


def test_with_several_updates_a_proximal_forward_precedes_them(tmp_path: Path, one_rank_group: None) -> None:
    records, worker = _run(tmp_path, Server(), steps=3, minibatches=2)
    assert [r["mismatched_tokens"] for r in records] == [0] * 3 and [r["gate"] for r in records] == ["passed"] * 3
    assert [r["recompute"] for r in records] == [True] * 3 and worker.old is not None
    assert [r["staleness"] for r in records] == [{"0": 8}, {"1": 8}, {"1": 8}]
    assert worker.recomputes == 3 + 2  # a proximal forward each step, and one under version 0, then 1


def test_a_token_compared_under_the_wrong_version_fails_the_gate(tmp_path: Path, one_rank_group: None) -> None:
    """The negative control: a server that labels version 1's tokens as version 2's (within the staleness
    the version check allows), so the gate compares them under the wrong weights."""
    records, worker = _run(tmp_path, Server(stale_label=True), steps=3)
    assert [r["gate"] for r in records] == ["passed", "passed", "failed"]
    assert records[2]["gate_check"] == "rollout_vs_sampling_version" and records[2]["mismatched_tokens"] == 8
    assert worker.version == 2  # the failed step trained nothing
