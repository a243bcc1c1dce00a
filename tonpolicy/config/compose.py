"""Compose the typed Config outside of `@hydra.main` (tests, tools, worker processes)."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tonpolicy.config.errors import ConfigError, unknown_keys
from tonpolicy.config.learning_rate import given_lr_wins
from tonpolicy.config.schema import Config, register_configs

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides: list[str] | None = None) -> Config:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=overrides or [])
    unknown = unknown_keys(dcfg)
    if unknown:
        raise ConfigError(unknown)
    said = given_lr_wins(dcfg, overrides or [])
    if said:
        print(f"tonpolicy: {said}", file=sys.stderr)
    return OmegaConf.to_object(dcfg)  # type: ignore[return-value]


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def load_config(path: str | Path) -> Config:
    """Read a resolved config file written by the launcher back into the typed schema."""
    schema = OmegaConf.structured(Config)
    return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(path)))  # type: ignore[return-value]
