"""The run's logprob reference, picked once from the config: which one each configuration gets and what
PPO trains on under it (the checks themselves run in test_step_loop.py and test_async_steps.py)."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.config.schema import Config, ExperimentConfig, TrainerConfig
from tonpolicy.loop.logprob_reference import (
    BeforeUpdate,
    FirstForwardReference,
    RecomputeReference,
    SamplingVersionsReference,
    logprob_reference,
)
from tonpolicy.loop.rollout_batch import Batch
from tonpolicy.rl.objective import PPOConfig
from tonpolicy.rl.train_samples import TrainSamples
from tonpolicy.trainer.ppo_loss import PPOLoss, TokenInputs, token_inputs


def _cfg(recompute: bool | None = None, staleness: int = 0, minibatches: int = 1) -> Config:
    return Config(
        experiment=ExperimentConfig(max_staleness=staleness),
        trainer=TrainerConfig(recompute_logprobs=recompute, ppo_minibatches=minibatches, tis_cap=2.0),
    )


@pytest.mark.parametrize(
    ("cfg", "kind", "recompute"),
    [
        (_cfg(), FirstForwardReference, False),  # an exact contract's default: no recompute
        (_cfg(recompute=True), RecomputeReference, True),
        (_cfg(staleness=1), SamplingVersionsReference, False),  # one update: the first forward is proximal
        (_cfg(staleness=1, minibatches=2), SamplingVersionsReference, True),  # several: a proximal forward
        (_cfg(recompute=True, staleness=1), SamplingVersionsReference, True),
    ],
)
def test_the_reference_follows_the_config(cfg: Config, kind: type, recompute: bool) -> None:
    ref = logprob_reference(cfg)
    assert type(ref) is kind and ref.recompute is recompute


def _batch() -> Batch:
    lps = [torch.tensor([-0.5, -0.25]), torch.tensor([-1.0, -0.125])]
    return Batch([[1], [2]], [0, 1], [[3, 4], [4, 3]], lps, [1.0, 0.0], [0.5, -0.5])


def test_what_ppo_trains_on_under_each_reference() -> None:
    batch, recomputed = _batch(), [torch.tensor([-0.5, -0.3]), torch.tensor([-1.0, -0.1])]
    plain = FirstForwardReference().train_samples(batch, BeforeUpdate(batch.rollout_logprobs))
    assert plain.old_logprobs is batch.rollout_logprobs and plain.behaviour_logprobs is None
    assert RecomputeReference().train_samples(batch, BeforeUpdate(recomputed)).old_logprobs is recomputed
    first_forward = SamplingVersionsReference(False, 1, 2.0).train_samples(batch, BeforeUpdate(batch.rollout_logprobs))
    assert first_forward.old_logprobs is None and first_forward.behaviour_logprobs is batch.rollout_logprobs
    proximal = SamplingVersionsReference(True, 1, 2.0).train_samples(batch, BeforeUpdate(recomputed))
    assert proximal.old_logprobs is recomputed and proximal.behaviour_logprobs is batch.rollout_logprobs


def test_minibatches_must_divide_the_samples() -> None:
    samples = TrainSamples([[1]] * 4, [[2]] * 4, None, [torch.zeros(1)] * 4, [0.0] * 4)
    assert samples.minibatches(2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="ppo_minibatches=3"):
        samples.minibatches(3)


def test_the_decoupled_loss_weighs_each_token_by_the_truncated_ratio() -> None:
    old, behaviour = torch.tensor([0.0, 0.0]), torch.tensor([-2.0, -0.1])
    samples = TrainSamples([[1]], [[2, 3]], [old], [behaviour], [1.0], behaviour_logprobs=[behaviour])
    (inputs,) = token_inputs(samples)
    assert TokenInputs.of(inputs.extras()) == inputs  # what the schedule slices reads back the same
    lp = torch.tensor([0.0, 0.0])  # ratio 1: the plain loss is -advantage per token
    weighted = PPOLoss(PPOConfig(0.2, 0.2, 0.0), tis_cap=2.0).per_token(inputs, lp)
    assert torch.allclose(weighted, -torch.stack([torch.tensor(2.0), torch.exp(torch.tensor(0.1))]))
