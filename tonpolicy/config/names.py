"""Names that follow what runs: a layout is labelled from its resolved sizes, not from the option
that was picked (`parallel=tp1 parallel.tp=2` runs, and is named, `tp2`)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from tonpolicy.config.layout import Layout


def layout_label(parallel: Any) -> str:
    """The layout's label (tonpolicy.config.layout.Layout.label) of a `parallel` config group."""
    return Layout.of(parallel).label


def register_resolvers() -> None:
    """`${layout:${parallel}}` in the Hydra config (run and sweep directory names)."""
    if not OmegaConf.has_resolver("layout"):
        OmegaConf.register_new_resolver("layout", layout_label)
