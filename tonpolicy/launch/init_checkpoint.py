"""`python -m tonpolicy.launch.init_checkpoint --config resolved_config.yaml --out DIR`: write the
seeded random initial weights in HF format (used by a hand-run launch.sh)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tonpolicy.config.compose import load_config
from tonpolicy.config.schema import Config


def write_init_checkpoint(cfg: Config, out: Path) -> Path:
    """Idempotent: an existing checkpoint at `out` is kept."""
    import torch

    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    if not (out / "config.json").exists():
        save_hf(init_state_dict(cfg.model, getattr(torch, cfg.contract.dtype), cfg.model.init_seed), cfg.model, out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    print(write_init_checkpoint(load_config(args.config), Path(args.out)))


if __name__ == "__main__":
    main()
