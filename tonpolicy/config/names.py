"""Names that follow what runs: a layout is labelled from its resolved sizes, not from the option
that was picked (`parallel=tp1 parallel.tp=2` runs, and is named, `tp2`)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf


def layout_label(parallel: Any) -> str:
    """tp{N} / pp{N}[_{layers}] / cp{N}_{type} / dp{N} / ep{N}, joined by '_', sizes of 1 left out (tp1 if
    all are); dp is left out too where it only holds the EP ranks (dp == ep, cp 1: `ep2` is dp2 ep2).
    The shipped options' names are exactly their labels."""
    p = parallel
    ep = getattr(p, "ep", 1)
    parts = []
    if p.tp > 1 or p.pp == p.cp == p.dp == 1:
        parts.append(f"tp{p.tp}")
    if p.pp > 1:
        layers = getattr(p, "pp_layers", None)
        parts.append(f"pp{p.pp}" + ("_" + "-".join(str(n) for n in layers) if layers else ""))
    if p.cp > 1:
        parts.append(f"cp{p.cp}_{p.cp_type}")
    if p.dp > 1 and not (ep > 1 and p.dp == ep and p.cp == 1):
        parts.append(f"dp{p.dp}")
    if ep > 1:
        parts.append(f"ep{ep}")
    return "_".join(parts)


def register_resolvers() -> None:
    """`${layout:${parallel}}` in the Hydra config (run and sweep directory names)."""
    if not OmegaConf.has_resolver("layout"):
        OmegaConf.register_new_resolver("layout", layout_label)
