"""`python -m tonpolicy [group=option ...]`: thin Hydra glue around tonpolicy.app.run."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from tonpolicy.config.schema import Config, register_configs
from tonpolicy.config.validate import ConfigError

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    from tonpolicy.app import run

    cfg: Config = OmegaConf.to_object(dcfg)  # type: ignore[assignment]
    try:
        code = run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as exc:
        print(f"tonpolicy: {exc}", file=sys.stderr)
        sys.exit(2)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
