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


def hf_config_mismatches(model: ModelConfig) -> list[tuple[str, Any, str]]:
    """(dotted key, value, rule) for every field where config.json disagrees with the profile."""
    path = Path(str(model.hf_config))
    if path.is_dir():
        path = path / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [("model.hf_config", str(model.hf_config), f"must be a readable HF config.json ({exc})")]

    out: list[tuple[str, Any, str]] = []
    archs = hf.get("architectures") or []
    if model.architecture not in archs:
        kind = " (a MoE architecture: use a MoE profile)" if any(m in a for a in archs for m in MOE_MARKERS) else ""
        out.append(("model.architecture", model.architecture, f"config.json declares {archs}{kind}"))
    for field, hf_key in HF_FIELDS.items():
        theirs = _rope_theta(hf) if field == "rope_theta" else hf.get(hf_key)
        if field == "tie_word_embeddings" and theirs is None:
            theirs = True  # HF's PretrainedConfig default
        ours = getattr(model, field)
        if theirs is None or (isinstance(ours, float) and float(theirs) != ours) or (
            not isinstance(ours, float) and theirs != ours
        ):
            out.append((f"model.{field}", ours, f"config.json has {hf_key}={theirs!r}"))
    return out
