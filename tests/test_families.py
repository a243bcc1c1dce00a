"""tonpolicy.families: every entry's four pieces exist where it says, and config validation knows the
registry (an unknown family is refused naming the key)."""

from __future__ import annotations

import ast
import inspect
from dataclasses import replace
from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config, group_options
from tonpolicy.families import FAMILIES, family, resolve
from tonpolicy.validation.validate import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_piece_resolves(name: str) -> None:
    f = family(name)
    model = resolve(f.engine_model)
    assert list(inspect.signature(model).parameters)[:4] == ["cfg", "kernels", "dtype", "state_dict"]
    assert list(inspect.signature(resolve(f.layer_spec)).parameters) == ["config", "provider"]
    adapter = resolve(f.hf_adapter)
    assert callable(adapter.config_from_hf)
    converter = resolve(f.megatron_weights)
    assert all(callable(getattr(converter, n)) for n in ("load_into", "megatron_to_hf", "megatron_state"))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_sglang_entry_is_an_entry_class(name: str) -> None:
    """The SGLang side cannot be imported here (no SGLang in this environment): read it instead. A
    family the package does not serve yet has no entry, and rollout=sglang is refused for it."""
    entry_path = family(name).sglang_entry
    if entry_path is None:
        model = next(o for o in group_options("model") if compose_config([f"model={o}"]).model.family == name)
        cfg = compose_config([f"model={model}", "rollout=sglang", "trainer.device=cuda"])
        with pytest.raises(ConfigError, match="does not serve family"):
            validate(cfg, check_hf=False)
        return
    module, _, cls = entry_path.partition(":")
    tree = ast.parse((ROOT / Path(*module.split("."))).with_suffix(".py").read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    entry = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "EntryClass")
    assert cls in classes and cls in {e.id for e in entry.value.elts}
    assert cls in family(name).hf_architectures  # SGLang picks the class by config.json's architectures


def test_an_unknown_family_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["model.family=llama"]), check_hf=False)
    assert "model.family='llama'" in str(e.value) and "qwen3" in str(e.value)
    with pytest.raises(ValueError, match="unknown model family 'llama'"):
        family("llama")


def test_the_old_kernel_set_name_is_told_the_new_one() -> None:
    with pytest.raises(ConfigError, match=r"renamed: use 'plain'"):
        validate(compose_config(["contract.kernels=default"]), check_hf=False)


def test_a_family_without_an_sglang_entry_is_refused_rollout_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family has an entry today; the refusal stays for one that has none (a new family)."""
    monkeypatch.setitem(FAMILIES, "qwen3_moe", replace(FAMILIES["qwen3_moe"], sglang_entry=None))
    cfg = compose_config(["model=qwen3_moe_tiny", "rollout=sglang", "trainer.device=cuda"])
    with pytest.raises(ConfigError, match="does not serve family qwen3_moe"):
        validate(cfg, check_hf=False)
    monkeypatch.undo()
    validate(cfg, check_hf=False)  # the package's Qwen3MoeForCausalLM serves it
