"""The Qwen3 HF adapter (tonpolicy.config.hf_qwen3) is the one source: config.json both ways with HF's
own defaults, the parameter names and the TP plan; the loader and the cross-check read a config.json
the same way."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tonpolicy.align.names import HF_LAYER_ROLES
from tonpolicy.config.compose import compose_config, group_options
from tonpolicy.config.hf_check import hf_config_mismatches
from tonpolicy.config.hf_qwen3 import (
    COLUMN,
    HF_DEFAULTS,
    HF_KEYS,
    LAYER_PARAMS,
    REPLICATED,
    ROW,
    config_from_hf,
    config_to_hf,
    hf_params,
    tp_kind,
)
from tonpolicy.config.model import ARCHITECTURE_FIELDS, MOE_FIELDS, ModelConfig
from tonpolicy.families import adapter
from tonpolicy.model.checkpoint import init_state_dict, load_hf, param_shapes, save_hf
from tonpolicy.trainer.weights import DIRECT, GATE_UP, QKV

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
PROFILES = group_options("model")


def _architecture(cfg: ModelConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}


def _profile(name: str) -> ModelConfig:
    return compose_config([f"model={name}"]).model


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


# --- config.json both ways ------------------------------------------------------------------------
def test_the_adapter_covers_every_architecture_field() -> None:
    assert set(HF_KEYS) == set(ARCHITECTURE_FIELDS) - set(MOE_FIELDS)
    assert set(HF_DEFAULTS) == set(HF_KEYS.values())
    moe = adapter("qwen3_moe")
    assert set(moe.HF_KEYS) == set(ARCHITECTURE_FIELDS)  # the MoE adapter: dense Qwen3's and the experts'
    assert set(moe.HF_DEFAULTS) == set(moe.HF_KEYS.values())


def _transformers_config(cfg: ModelConfig):  # the family's transformers config class
    return transformers.Qwen3MoeConfig if cfg.is_moe else transformers.Qwen3Config


@pytest.mark.parametrize("name", PROFILES)
def test_round_trip_of_every_profile(name: str) -> None:
    cfg = _profile(name)
    ad = adapter(cfg.family)
    assert ad.config_from_hf(ad.config_to_hf(cfg), base=cfg) == cfg
    # Nothing architectural comes from `base`: read onto another profile, the file alone decides.
    other = ModelConfig(**{**_architecture(ModelConfig()), "num_layers": cfg.num_layers + 1, "rope_theta": 3.0})
    assert _architecture(ad.config_from_hf(ad.config_to_hf(cfg), base=other)) == _architecture(cfg)


@pytest.mark.parametrize("name", PROFILES)
def test_transformers_reads_what_we_write(name: str) -> None:
    cfg = _profile(name)
    ad = adapter(cfg.family)
    theirs = _transformers_config(cfg).from_dict(ad.config_to_hf(cfg)).to_dict()
    assert _architecture(ad.config_from_hf(theirs)) == _architecture(cfg)


@pytest.mark.parametrize("field", sorted(HF_KEYS))
def test_an_absent_key_reads_as_transformers_reads_it(field: str) -> None:
    """Drop one key: the adapter's value is the one transformers' Qwen3Config gives (its defaults)."""
    full = config_to_hf(_profile("qwen3_tiny"))
    dropped = (HF_KEYS[field], "rope_parameters") if field == "rope_theta" else (HF_KEYS[field],)
    d = _without(full, *dropped)
    ours = config_from_hf(d)
    hf = transformers.Qwen3Config.from_dict(d).to_dict()
    assert getattr(ours, field) == getattr(config_from_hf(hf), field)
    assert getattr(ours, field) != getattr(config_from_hf(full), field) or field == "rms_norm_eps"


def test_an_empty_config_is_transformers_default_qwen3() -> None:
    hf = transformers.Qwen3Config().to_dict()
    assert _architecture(config_from_hf({})) == _architecture(config_from_hf(hf))
    assert config_from_hf({}).tie_word_embeddings is False  # HF Qwen3Config's default


def test_an_explicit_null_kv_head_count_means_one_per_attention_head() -> None:
    d = {"num_attention_heads": 6, "num_key_value_heads": None}
    assert config_from_hf(d).num_kv_heads == 6 == transformers.Qwen3Config.from_dict(d).num_key_value_heads


def test_rope_theta_under_rope_parameters_wins_as_in_transformers() -> None:
    d = {"rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    assert config_from_hf(d).rope_theta == 7.0 == transformers.Qwen3Config.from_dict(d).rope_parameters["rope_theta"]


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ({"num_experts": 8}, "mixture-of-experts"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "default RoPE"),
    ],
)
def test_a_model_the_family_does_not_describe_is_refused(extra: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        config_from_hf({**config_to_hf(ModelConfig()), **extra})


def test_a_wrongly_typed_value_is_refused() -> None:
    with pytest.raises(TypeError, match="hidden_size='128'"):
        config_from_hf({**config_to_hf(ModelConfig()), "hidden_size": "128"})


# --- the loader and the cross-check agree -----------------------------------------------------------
def _write(tmp_path: Path, d: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path / "config.json"


def test_no_tie_word_embeddings_is_untied_for_loader_and_cross_check(tmp_path: Path) -> None:
    """The old disagreement: the cross-check read an absent key as tied, the loader as untied."""
    cfg = replace(_profile("qwen3_tiny"), tie_word_embeddings=False)
    save_hf(init_state_dict(cfg, torch.float32, seed=0), cfg, tmp_path)
    _write(tmp_path, _without(json.loads((tmp_path / "config.json").read_text()), "tie_word_embeddings"))
    loaded, sd = load_hf(tmp_path)
    assert loaded.tie_word_embeddings is False and "lm_head.weight" in sd
    assert hf_config_mismatches(cfg, tmp_path / "config.json") == []
    tied = replace(cfg, tie_word_embeddings=True)
    assert [k for k, _, _ in hf_config_mismatches(tied, tmp_path / "config.json")] == ["model.tie_word_embeddings"]


def _variants(cfg: ModelConfig) -> list[dict]:
    full = config_to_hf(cfg)
    out = [full, {**full, "hidden_size": cfg.hidden_size * 2}, {**full, "architectures": ["Qwen3MoeForCausalLM"]}]
    out += [_without(full, key) for key in HF_DEFAULTS]
    out += [
        _without(full, "rope_theta"),
        _without(full, "rope_parameters"),
        _without(full, "rope_theta", "rope_parameters"),
    ]
    return out


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_4b"])
def test_cross_check_and_loader_give_the_same_answer(tmp_path: Path, name: str) -> None:
    """On every variant of a config.json: the fields the cross-check reports are exactly those where the
    loaded config differs from the profile (what check_same_architecture refuses)."""
    profile = _profile(name)
    for d in _variants(profile):
        reported = {k.removeprefix("model.") for k, _, _ in hf_config_mismatches(profile, _write(tmp_path, d))}
        loaded = config_from_hf(d)
        differing = {f for f in ARCHITECTURE_FIELDS if getattr(loaded, f) != getattr(profile, f)}
        assert reported == differing, (sorted(set(config_to_hf(profile)) - set(d)), reported, differing)


# --- parameter names and the TP plan ----------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_names_cover_exactly_a_saved_checkpoint(tmp_path: Path, tied: bool) -> None:
    cfg = replace(_profile("qwen3_tiny"), tie_word_embeddings=tied)
    save_hf(init_state_dict(cfg, torch.float32, seed=1), cfg, tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    plan = hf_params(cfg)
    assert set(saved) == set(plan) == set(param_shapes(cfg))
    assert {n: tuple(t.shape) for n, t in saved.items()} == {n: p.shape for n, p in plan.items()}
    for name, p in plan.items():
        assert tp_kind(name) == p.tp
        assert p.shard_dim is None or p.shard_dim < len(p.shape), name


def test_the_tp_plan_is_transformers_own() -> None:
    hf_kind = {"colwise": COLUMN, "rowwise": ROW}
    theirs = {
        k.removeprefix("layers.*.") + ".weight": hf_kind.get(v, REPLICATED if "replicated" in v else v)
        for k, v in transformers.Qwen3Config.base_model_tp_plan.items()
    }
    assert theirs == {k: v for k, v in LAYER_PARAMS.items() if "layernorm" not in k}
    assert all(LAYER_PARAMS[k] == REPLICATED for k in LAYER_PARAMS if "layernorm" in k)


def test_every_engine_maps_exactly_the_adapters_layer_params() -> None:
    assert set(HF_LAYER_ROLES) == set(LAYER_PARAMS)  # align's roles
    assert {*DIRECT, *QKV, *GATE_UP} == set(LAYER_PARAMS)  # the Megatron conversion
    assert all(LAYER_PARAMS[h] == COLUMN for h in (*QKV, *GATE_UP))  # fused after a column split
    # The SGLang model package (not importable here): the keys of its `_destinations` table.
    tree = ast.parse((ROOT / "tonpolicy/inside_sglang/model/qwen3.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_destinations")
    table = next(n for n in ast.walk(fn) if isinstance(n, ast.Dict))
    keys = {k.value for k in table.keys if isinstance(k, ast.Constant)}
    # The dense MLP's entries are added to the table apart (a MoE layer's experts load elsewhere).
    keys |= {
        t.slice.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
    }
    assert keys == set(LAYER_PARAMS)


def test_the_engine_model_has_the_adapters_parameters() -> None:
    from tonpolicy.kernels import get_kernels
    from tonpolicy.model import Qwen3

    cfg = replace(_profile("qwen3_tiny"), num_layers=1, tie_word_embeddings=False)
    model = Qwen3(cfg, get_kernels("plain"), torch.float32)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: p.shape for n, p in hf_params(cfg).items()}
