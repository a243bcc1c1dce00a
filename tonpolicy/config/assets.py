"""Files shipped inside the package (tonpolicy/assets/), named from a config as `${asset:bpe_chat/train.jsonl}`:
the interpolation resolves to the file's absolute path wherever tonpolicy is installed and whatever the
working directory, so a shipped example runs as `python -m tonpolicy experiment=bpe_chat` from anywhere."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

ASSETS = Path(__file__).resolve().parents[1] / "assets"
RESOLVER = "asset"


def asset_path(relative: str) -> str:
    """The absolute path of `relative` under tonpolicy/assets/; one that leads outside it or names nothing
    there is refused (the error names the interpolation and the folder)."""
    path = (ASSETS / relative).resolve()
    if not path.is_relative_to(ASSETS):
        raise ValueError(f"${{{RESOLVER}:{relative}}} must name a file or folder inside {ASSETS}")
    if not path.exists():
        raise ValueError(f"${{{RESOLVER}:{relative}}}: no {relative} in {ASSETS}")
    return str(path)


def register_asset_resolver() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, asset_path)
