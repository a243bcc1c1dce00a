"""The one place to add a model family: what each engine builds for it.

An entry names, by import path, the family's pieces: the engine model on a kernel set (knows no
parallelism), the Megatron layer spec (built from a spec provider), the model class SGLang loads from
tonpolicy's model package, the HF adapter (config.json both ways, parameter names, TP plan) and the
weight converter between HF and Megatron names. Paths, not imports: this module sits below every room
that uses it, and each room imports only its own piece (the trainer never loads the engine model,
tonpolicy never loads the SGLang side).

`model.family` and `contract.family` name an entry here; `tests/test_families.py` resolves every path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    name: str
    hf_architectures: tuple[str, ...]  # config.json "architectures" this family reads
    engine_model: str  # "module:Class", constructed as Class(cfg, kernels, dtype, state_dict)
    layer_spec: str  # "module:function", function(config, provider) -> TransformerBlockSubmodules
    # "module:Class" of the SGLang model package (module defines EntryClass); None: the package does not
    # serve this family yet, and validation refuses rollout=sglang for it.
    sglang_entry: str | None
    hf_adapter: str  # module with config_from_hf / config_to_hf, parameter names and the TP plan
    # module with load_into / megatron_to_hf / megatron_state: HF weights <-> Megatron's, any TP/PP split
    megatron_weights: str
    routed_experts: bool = False  # a mixture of experts (its contract fingerprints the MoE ops)


FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(
        name="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        engine_model="tonpolicy.model.qwen3:Qwen3",
        layer_spec="tonpolicy.trainer.layer_spec:dense_block_spec",
        sglang_entry="tonpolicy.inside_sglang.model.qwen3:Qwen3ForCausalLM",
        hf_adapter="tonpolicy.config.hf_qwen3",
        megatron_weights="tonpolicy.trainer.weights",
    ),
    "qwen3_moe": ModelFamily(
        name="qwen3_moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        engine_model="tonpolicy.model.qwen3_moe:Qwen3Moe",
        layer_spec="tonpolicy.trainer.layer_spec:moe_block_spec",
        sglang_entry="tonpolicy.inside_sglang.model.qwen3_moe:Qwen3MoeForCausalLM",
        hf_adapter="tonpolicy.config.hf_qwen3_moe",
        megatron_weights="tonpolicy.trainer.weights",  # its routed layers through moe_weights
        routed_experts=True,
    ),
}


# contract.family of a contract that makes no numerics promise (the off-policy control): any model.
ANY_FAMILY = "any"


def family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: one of {sorted(FAMILIES)} (tonpolicy/families.py)")
    return FAMILIES[name]


def adapter(name: str) -> Any:
    """The HF adapter module of family `name`."""
    return resolve(family(name).hf_adapter)


def megatron_weights(name: str) -> Any:
    """The module converting family `name`'s HF weights to Megatron's and back."""
    return resolve(family(name).megatron_weights)


def family_of_hf(hf: dict[str, Any]) -> ModelFamily:
    """The family that reads an HF config.json: by its first architecture, else its model_type; dense
    Qwen3 when neither names a family (its adapter then says what does not fit)."""
    archs = hf.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    for fam in FAMILIES.values():
        if arch in fam.hf_architectures or (arch is None and hf.get("model_type") == fam.name):
            return fam
    return FAMILIES["qwen3"]


def resolve(path: str) -> Any:
    """'package.module:attr' -> the object (imported on first use)."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj
