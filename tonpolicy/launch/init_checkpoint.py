"""`python -m tonpolicy.launch.init_checkpoint --config resolved_config.yaml --out DIR`: write the
seeded random initial weights in HF format (used by a hand-run launch.sh)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tonpolicy.config.compose import load_config
from tonpolicy.config.schema import Config

# What a model.tokenizer folder may give the checkpoint: the tokenizer and what HF loaders (and SGLang)
# read beside it; nothing else, so a folder can never bring weights or another config.json.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def write_init_checkpoint(cfg: Config, out: Path) -> Path:
    """Idempotent: an existing checkpoint at `out` is kept."""
    import torch

    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    if not (out / "config.json").exists():
        save_hf(init_state_dict(cfg.model, getattr(torch, cfg.contract.dtype), cfg.model.init_seed), cfg.model, out)
        if cfg.model.tokenizer:
            write_tokenizer(cfg.model.tokenizer, out)
    return out


def write_tokenizer(source: str | Path, out: Path) -> None:
    """`source`'s tokenizer files (model.tokenizer) into `out`, in place of the tiny models' word-level
    tokenizer, which would otherwise be left beside them (its tokenizer_config.json names other tokens)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)
            (out / name).chmod(0o644)  # read by other users' servers, as the weights are


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    print(write_init_checkpoint(load_config(args.config), Path(args.out)))


if __name__ == "__main__":
    main()
