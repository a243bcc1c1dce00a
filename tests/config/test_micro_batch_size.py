"""The derived micro batch size: whole microbatches per replica, at least one per pipeline stage, at most
DERIVED_MICRO_BATCH_MAX samples; an explicit value or parallel.num_microbatches decides instead."""

from __future__ import annotations

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.layout import DERIVED_MICRO_BATCH_MAX
from tonpolicy.config.sizes import micro_batch_size, microbatches_per_replica
from tonpolicy.validation.validate import validate


@pytest.mark.parametrize(
    ("overrides", "size", "count"),
    [
        ([], DERIVED_MICRO_BATCH_MAX, 128 // DERIVED_MICRO_BATCH_MAX),  # the default job: 128 samples
        (["parallel.dp=2"], 8, 8),
        (["experiment.prompts_per_step=3", "experiment.samples_per_prompt=2"], 6, 1),
        (["experiment.prompts_per_step=5", "experiment.samples_per_prompt=1"], 5, 1),
        (["experiment.prompts_per_step=7", "experiment.samples_per_prompt=2"], 7, 2),
        (["experiment=parity_smoke", "parallel.pp=2"], 4, 2),  # 8 samples, each stage gets work
        (["experiment=parity_smoke", "parallel.pp=2", "parallel.num_microbatches=4"], 2, 4),
        (["trainer.ppo_minibatches=4"], 8, 4),
        (["trainer.micro_batch_size=1"], 1, 128),
    ],
)
def test_derived_size(overrides: list[str], size: int, count: int) -> None:
    cfg = compose_config(overrides)
    validate(cfg, check_hf=False)
    assert (micro_batch_size(cfg), microbatches_per_replica(cfg)) == (size, count)
