"""trainer.recompute_logprobs, ppo_epochs and ppo_minibatches as composed and validated: the default job
(exact contract) has no recompute, off_policy has it; bad counts are refused naming key, value and rule,
all at once; a minibatch must hold whole microbatches on every replica."""

from __future__ import annotations

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.sizes import microbatches_per_replica
from tonpolicy.loop.gate_policy import recomputes_logprobs
from tonpolicy.validation.validate import ConfigError, validate


def test_the_default_job_skips_the_recompute_and_off_policy_keeps_it() -> None:
    default = compose_config([])
    validate(default)
    assert default.trainer.recompute_logprobs is None and default.contract.exact_zero
    assert not recomputes_logprobs(default)
    assert (default.trainer.ppo_epochs, default.trainer.ppo_minibatches) == (1, 1)
    assert recomputes_logprobs(compose_config(["contract=off_policy"]))
    assert recomputes_logprobs(compose_config(["trainer.recompute_logprobs=true"]))
    # Allowed: off_policy with the rollout's logprobs as PPO's old ones (slime's --use-rollout-logprobs).
    off = compose_config(["contract=off_policy", "trainer.recompute_logprobs=false"])
    validate(off)
    assert not recomputes_logprobs(off)


def test_minibatches_that_divide_the_batch_are_valid() -> None:
    cfg = compose_config(
        ["experiment=parity_smoke", "trainer.ppo_minibatches=2", "trainer.ppo_epochs=3", "trainer.micro_batch_size=1"]
    )
    validate(cfg)
    batch = cfg.experiment.prompts_per_step * cfg.experiment.samples_per_prompt
    assert microbatches_per_replica(cfg) == batch // 2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.ppo_epochs=0", "trainer.ppo_minibatches=0"],
            ["trainer.ppo_epochs=0: must be a positive integer", "trainer.ppo_minibatches=0: must be a positive"],
        ),
        (
            ["experiment=parity_smoke", "trainer.ppo_minibatches=3"],
            [
                "trainer.ppo_minibatches=3: must divide the step's batch "
                "(experiment.prompts_per_step*samples_per_prompt=8)"
            ],
        ),
        (
            ["experiment=parity_smoke", "trainer.ppo_minibatches=4", "parallel.dp=2", "trainer.micro_batch_size=2"],
            [
                "trainer.micro_batch_size=2: parallel.dp*micro_batch_size=4 must divide each of the "
                "trainer.ppo_minibatches=4 minibatches (2 samples)"
            ],
        ),
        (
            ["experiment=parity_smoke", "parallel.pp=2", "trainer.ppo_minibatches=8"],
            ["leaves 1 microbatches per replica, fewer than parallel.pp=2"],
        ),
    ],
)
def test_bad_ppo_counts_are_refused(overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides))
    for text in expected:
        assert text in str(info.value), str(info.value)
