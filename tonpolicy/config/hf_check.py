"""Cross-check a model profile against a Hugging Face config.json (`model.hf_config=...`).

The file is read as the loader reads it (the profile family's HF adapter, HF's defaults for absent keys),
so a config.json the check accepts is the model the engines load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tonpolicy.config.model import ModelConfig
from tonpolicy.families import FAMILIES, adapter

MOE_MARKERS = ("Moe", "MoE")


def _read(path: Path, key: str) -> dict[str, Any] | tuple[str, Any, str]:
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return (key, str(path), f"must be a readable UTF-8 HF config.json ({type(exc).__name__}: {exc})")
    if not isinstance(hf, dict):
        return (key, str(path), f"must hold a JSON object (an HF config), not a {type(hf).__name__}")
    return hf


def hf_config_mismatches(
    model: ModelConfig, path: str | Path | None = None, key: str = "model.hf_config"
) -> list[tuple[str, Any, str]]:
    """(dotted key, value, rule) for every field where config.json (`path`, default model.hf_config;
    `key` names the config key it came from) disagrees with the profile."""
    path = Path(str(path if path is not None else model.hf_config))
    if path.is_dir():
        path = path / "config.json"
    hf = _read(path, key)
    if isinstance(hf, tuple):
        return [hf]

    out: list[tuple[str, Any, str]] = []
    fam = FAMILIES.get(model.family)
    if fam is None:  # validation names the unknown family
        return out
    hf_ad = adapter(fam.name)
    archs = hf.get("architectures") or []
    if hf_ad.hf_value(hf, "architecture") != model.architecture:
        moe = any(m in str(a) for a in archs for m in MOE_MARKERS)
        if moe and not model.is_moe:
            kind = " (a MoE architecture: use a MoE profile)"
        elif archs and not moe and model.is_moe:
            kind = " (a dense architecture: use a dense profile)"
        else:
            kind = ""
        out.append(("model.architecture", model.architecture, f"{key} declares {archs}{kind}"))
    else:
        out += [
            ("model.architecture", model.architecture, f"{key} has {k}={v!r}: {why}")
            for k, v, why in hf_ad.unsupported(hf)
        ]
    for field, hf_key in hf_ad.HF_KEYS.items():
        if field == "architecture":
            continue
        theirs, ours = hf_ad.hf_value(hf, field), getattr(model, field)
        try:
            same = hf_ad.convert(field, theirs) == ours
        except TypeError:
            same = False
        if not same:
            default = " (absent: HF's default)" if hf_ad.hf_is_default(hf, field) else ""
            if field == "num_experts" and hf_key not in hf and "num_local_experts" in hf:
                hf_key = "num_local_experts"
            out.append((f"model.{field}", ours, f"{key} has {hf_key}={theirs!r}{default}"))
    return out
