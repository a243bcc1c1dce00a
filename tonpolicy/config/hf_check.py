"""Cross-check a model profile against a Hugging Face config.json (`model.hf_config=...`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tonpolicy.config.model import ModelConfig

# profile field -> config.json key
HF_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
MOE_MARKERS = ("Moe", "MoE")


def _rope_theta(hf: dict[str, Any]) -> Any:
    # transformers >= 5 moves rope_theta under rope_parameters.
    if "rope_theta" in hf:
        return hf["rope_theta"]
    return (hf.get("rope_parameters") or {}).get("rope_theta")


# config.json keys that only a mixture-of-experts model has.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def hf_config_mismatches(
    model: ModelConfig, path: str | Path | None = None, key: str = "model.hf_config"
) -> list[tuple[str, Any, str]]:
    """(dotted key, value, rule) for every field where config.json (`path`, default model.hf_config;
    `key` names the config key it came from) disagrees with the profile."""
    path = Path(str(path if path is not None else model.hf_config))
    if path.is_dir():
        path = path / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [(key, str(path), f"must be a readable UTF-8 HF config.json ({type(exc).__name__}: {exc})")]
    if not isinstance(hf, dict):
        return [(key, str(path), f"must hold a JSON object (an HF config), not a {type(hf).__name__}")]

    out: list[tuple[str, Any, str]] = []
    archs = hf.get("architectures") or []
    moe = [k for k in MOE_KEYS if hf.get(k)]
    if model.architecture not in archs:
        kind = (
            " (a MoE architecture: use a MoE profile)" if any(m in str(a) for a in archs for m in MOE_MARKERS) else ""
        )
        out.append(("model.architecture", model.architecture, f"{key} declares {archs}{kind}"))
    elif moe:
        out.append(
            (
                "model.architecture",
                model.architecture,
                f"{key} has {moe[0]}={hf[moe[0]]!r}: a mixture-of-"
                "experts model, which the dense profiles do not describe",
            )
        )
    for field, hf_key in HF_FIELDS.items():
        theirs = _rope_theta(hf) if field == "rope_theta" else hf.get(hf_key)
        if field == "tie_word_embeddings" and theirs is None:
            theirs = True  # HF's PretrainedConfig default
        ours = getattr(model, field)
        if isinstance(ours, float) and not isinstance(theirs, bool):
            try:
                same = theirs is not None and float(theirs) == ours
            except (TypeError, ValueError):
                same = False
        else:
            same = theirs is not None and theirs == ours
        if not same:
            out.append((f"model.{field}", ours, f"{key} has {hf_key}={theirs!r}"))
    return out
