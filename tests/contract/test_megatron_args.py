"""The plan describes what runs: the Megatron model the trainer builds has exactly the
TransformerConfig and GPTModel settings the launch plan renders (one source,
tonpolicy.contract.megatron_args), and the stage sizes the plan's pipeline split declares; and the
launcher runs the plan's commands, with only the launch-time values filled in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tonpolicy.align import harness
from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import pipeline_stage_layers
from tonpolicy.launch.plan import launch_plan
from tonpolicy.launch.rollout_fleet import with_flags
from tonpolicy.trainer.process_groups import spawn

CASES = [
    ["parallel=tp2"],
    ["parallel=pp2", "parallel.pp_layers=[3,1]", "contract.dtype=float32"],
    ["contract=off_policy", "parallel=tp2"],
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_built_model_equals_plan(overrides: list[str], tmp_path: Path) -> None:
    cfg = compose_config(overrides)
    plan = launch_plan(cfg, tmp_path)["megatron"]
    (built,) = spawn(harness.built_config_worker, cfg.parallel.tp * cfg.parallel.pp, [cfg])
    assert built["transformer_config"] == plan["transformer_config"]
    assert built["gpt_model"] == plan["gpt_model"]
    assert built["stage_layers"] == pipeline_stage_layers(cfg.model.num_layers, cfg.parallel.pp, cfg.parallel.pp_layers)


def test_launcher_fills_only_launch_time_values(tmp_path: Path) -> None:
    plan = launch_plan(compose_config([]), tmp_path)
    cmd = plan["trainer_command"]
    argv = with_flags(
        cmd, {"--master-port": 1234, "--server-url": "http://127.0.0.1:9", "--checkpoint": "/w"}, python="/py"
    )
    changed = [i for i, (a, b) in enumerate(zip(cmd, argv, strict=True)) if a != b]
    assert [cmd[i - 1] for i in changed[1:]] == ["--master-port", "--server-url", "--checkpoint"] and changed[0] == 0
    with pytest.raises(ValueError, match="--nope"):
        with_flags(cmd, {"--nope": 1})
