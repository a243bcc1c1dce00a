"""docs/ARCHITECTURE.md's "Where to add", true by test: a model family, a kernel set, a rollout backend and a task, each
registered in its one place, are accepted by validation and rendered into the plan with no other edit
(and unregistered after)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.rollout_backends import (
    RolloutBackend,
    register_rollout_backend,
    rollout_backend,
    unregister_rollout_backend,
)
from tonpolicy.config.schema import Config
from tonpolicy.families import FAMILIES, adapter, megatron_weights
from tonpolicy.kernels import sets
from tonpolicy.launch.plan import launch_plan
from tonpolicy.launch.sglang_env import trainer_python
from tonpolicy.rl.task import Task, get_task, make_prompts, register_task, reward, unregister_task
from tonpolicy.validation.validate import ConfigError, validate

DUMMY_ENV = {"DUMMY_SERVER_MODE": "test"}


def dummy_server_argv(cfg: Config, run_dir: Path, model_path: str, device: str, port: int) -> list[str]:
    return ["python", "-m", "dummy_server", "--model-path", model_path, "--port", str(port)]


def dummy_server_env(cfg: Config, device: str, fingerprint: str) -> dict[str, str]:
    return dict(DUMMY_ENV)


def _dummy_prompt(rng: random.Random, max_digits: int, target: int) -> list[int]:
    return [6, 4]


def _dummy_reward(prompt: list[int], response: list[int], graded: int, target: int) -> float:
    return 1.0 if response[:1] == [10 + target] else 0.0


def _dummy_rules(cfg: Config, bad: Any) -> None:
    if cfg.experiment.max_new_tokens > 8:
        bad("experiment.max_new_tokens", "the dummy server answers at most 8 tokens")


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    qwen3 = FAMILIES["qwen3"]  # a family entry naming Qwen3's pieces under another name
    monkeypatch.setitem(FAMILIES, "dummy_family", qwen3.__class__(**{**vars(qwen3), "name": "dummy_family"}))
    plain = sets.kernel_set("plain")
    monkeypatch.setitem(sets._REGISTRY, "dummy_kernels", plain.__class__(**{**vars(plain), "name": "dummy_kernels"}))
    register_rollout_backend(
        RolloutBackend(
            name="dummy_backend",
            server_command=f"{__name__}:dummy_server_argv",
            server_environment=f"{__name__}:dummy_server_env",
            interpreter=lambda cfg: "/opt/dummy/bin/python",
            engine_ranks=lambda cfg: 1,
            reports_port=False,
            sharded=False,
            spans_nodes=False,
            decode_graphs=False,
            reports_contract=True,
            family_served=lambda family: True,
            rules=_dummy_rules,
        )
    )
    register_task(Task("dummy_task", _dummy_prompt, _dummy_reward))
    try:
        yield
    finally:
        unregister_rollout_backend("dummy_backend")
        unregister_task("dummy_task")


OVERRIDES = [
    "contract=off_policy",  # a non-invariant contract: the dummy kernels promise no invariance
    "model.family=dummy_family",
    "contract.kernels=dummy_kernels",
    "rollout.backend=dummy_backend",
    "contract.supported_rollout_backends=[embedded,sglang,dummy_backend]",
    "task.name=dummy_task",
    "experiment.max_new_tokens=4",
    "task.graded_tokens=1",
]


def test_registered_names_are_validated_and_planned(registered: None, tmp_path: Path) -> None:
    cfg = compose_config(OVERRIDES)
    validate(cfg, check_hf=False)
    plan = launch_plan(cfg, tmp_path)
    assert plan["rollout"]["command"][:3] == ["python", "-m", "dummy_server"]
    assert plan["rollout"]["environment"] == DUMMY_ENV
    assert plan["trainer_command"][0] == "/opt/dummy/bin/python" == trainer_python(cfg)
    assert plan["megatron"]["kernels"]["name"] == "dummy_kernels"
    # the rooms that are not the family's own reach its pieces through the entry
    assert adapter("dummy_family").LM_HEAD == "lm_head.weight" and megatron_weights("dummy_family").load_into
    prompts = make_prompts("dummy_task", 0, 2, seed=0, max_prompt_len=8)
    assert prompts == [[6, 4], [6, 4]] and reward("dummy_task", [6, 4], [17], 1, target=7) == 1.0


def test_a_registered_backend_s_own_rules_are_checked(registered: None) -> None:
    with pytest.raises(ConfigError, match="the dummy server answers at most 8 tokens"):
        validate(compose_config([*OVERRIDES, "experiment.max_new_tokens=16"]), check_hf=False)


def test_unregistered_names_are_refused_listing_the_known_ones() -> None:
    """The negative control: the same names, not registered, are unknown to validation and lookups."""
    with pytest.raises(ConfigError) as e:
        validate(compose_config(OVERRIDES), check_hf=False)
    text = str(e.value)
    for key in (
        "model.family='dummy_family'",
        "contract.kernels='dummy_kernels'",
        "rollout.backend='dummy_backend'",
        "task.name='dummy_task'",
    ):
        assert key in text
    assert "must be one of" in text and "'sglang'" in text and "'calculator'" in text
    with pytest.raises(KeyError, match="known: embedded, sglang"):
        rollout_backend("dummy_backend")
    with pytest.raises(KeyError, match="unknown task"):
        get_task("dummy_task")
