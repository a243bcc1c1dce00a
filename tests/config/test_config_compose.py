"""Every option of every config group composes into the typed schema and validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config, group_options
from tonpolicy.config.schema import GROUPS, Config
from tonpolicy.validation.validate import ConfigError, validate

MOE_CONTRACTS = ("qwen3_moe_v1", "qwen3_moe_v2")


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert group_options(group), group


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_composes(group: str) -> None:
    for option in group_options(group):
        overrides = [f"{group}={option}"]
        if group == "rollout" and option == "sglang":
            overrides.append("trainer.device=cuda")  # SGLang is refused on CPU by validation
        if group == "task" and option == "digit_copy":
            overrides.append("experiment.max_new_tokens=4")  # the default run's answers are one token
        if group == "contract" and option in MOE_CONTRACTS:
            overrides.append("model=qwen3_moe_tiny")  # a MoE contract is for MoE models
        cfg = compose_config(overrides)
        if cfg.parallel.ep > 1:  # expert parallelism needs a mixture of experts
            cfg = compose_config([*overrides, "model=qwen3_moe_tiny"])
        assert isinstance(cfg, Config)
        validate(cfg, check_hf=False)


@pytest.mark.parametrize("layout", group_options("parallel"))
def test_every_layout_with_every_model(layout: str) -> None:
    for model in group_options("model"):
        cfg = compose_config([f"parallel={layout}", f"model={model}"])
        if cfg.parallel.ep > 1 and not cfg.model.is_moe:  # expert parallelism needs experts
            with pytest.raises(ConfigError, match="parallel.ep"):
                validate(cfg)
            continue
        if cfg.parallel.cp > 1 and cfg.model.is_moe:  # the MoE contract has no CP type yet
            with pytest.raises(ConfigError, match="parallel.cp_type"):
                validate(cfg)
            continue
        validate(cfg)


def test_a_moe_profile_brings_its_contract() -> None:
    cfg = compose_config(["model=qwen3_moe_tiny"])
    assert (cfg.contract.name, cfg.model.family) == ("qwen3_moe_v2", "qwen3_moe")
    assert compose_config(["model=qwen3_moe_tiny", "contract=off_policy"]).contract.name == "off_policy"
    with pytest.raises(ConfigError, match="contract.family"):
        validate(compose_config(["model=qwen3_moe_tiny", "contract=qwen3_dense_v2"]))
    with pytest.raises(ConfigError, match="contract.family"):
        validate(compose_config(["contract=qwen3_moe_v2"]))


def test_defaults() -> None:
    cfg = compose_config()
    assert (cfg.contract.name, cfg.model.name, cfg.parallel.name) == ("qwen3_dense_v2", "qwen3_tiny", "tp1")
    assert cfg.rollout.host == "127.0.0.1"
    assert cfg.logger.mode is None  # W&B's environment, else offline (launch.wandb_log)
    assert cfg.model.vocab_size % 128 != 0


def test_schema_rejects_unknown_keys_and_types() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_config(["parallel.tpp=2"])
    with pytest.raises(ConfigCompositionException):
        compose_config(["parallel.tp=two"])


def test_submitit_launcher_config_composes() -> None:
    from hydra import compose, initialize_config_dir

    from tonpolicy.config.compose import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")


def test_user_conf_dir_is_searched(tmp_path, monkeypatch) -> None:
    """A conf/ folder in the working directory adds options to any group (hydra.searchpath)."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "defaults:\n  - base_experiment\n  - _self_\n\nname: mine\nsteps: 5\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["experiment=mine"])
    assert (cfg.experiment.name, cfg.experiment.steps) == ("mine", 5)
    validate(cfg, check_hf=False)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "conf").glob("*/*.yaml")))
def test_repo_conf_options_compose(path: Path, monkeypatch) -> None:
    """The example options in the repository's top-level conf/ compose and validate."""
    monkeypatch.chdir(path.parents[2])
    overrides = [f"{path.parent.name}={path.stem}"]
    if "task=" in path.read_text():
        overrides.append("task=digit_copy")  # the example sweeps the copy task, as its header says
    validate(compose_config(overrides), check_hf=False)
