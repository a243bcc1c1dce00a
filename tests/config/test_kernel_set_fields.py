"""Validation reads a kernel set's fixed tile, devices, interpreter and row-tile rule from its spec: a dummy
set registered with its own values gets its own rules, by field, with no name compared anywhere."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.kernels import sets
from tonpolicy.validation.validate import ConfigError, validate

BASE = ["contract=off_policy", "contract.kernels=dummy_gpu", "trainer.device=cpu"]


@pytest.fixture
def dummy_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    spec = replace(
        sets.kernel_set("plain"),
        name="dummy_gpu",
        devices=("cuda",),
        fixed_attention_tile=16,
        row_tile_multiple=8,
        kernel_language="Dummy",
        cpu_interpreter_env="DUMMY_INTERPRET",
    )
    monkeypatch.setitem(sets._REGISTRY, "dummy_gpu", spec)
    monkeypatch.delenv("DUMMY_INTERPRET", raising=False)
    yield


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose_config(overrides), check_hf=False)
    return str(e.value)


def test_a_gpu_only_set_s_fields_are_its_rules(dummy_gpu: None) -> None:
    text = _problems([*BASE, "contract.attention_tile=32", "contract.row_tile=12"])
    assert "the dummy_gpu kernel set uses 16-key tiles" in text
    assert "runs Dummy kernels on CUDA GPUs: set trainer.device=cuda (on a CPU only under DUMMY_INTERPRET=1" in text
    assert "contract.row_tile=12: must be a multiple of 8 (GEMMs of 1-7 rows" in text


def test_its_interpreter_lets_a_cpu_run_it(dummy_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUMMY_INTERPRET", "1")
    validate(compose_config([*BASE, "contract.attention_tile=16", "contract.row_tile=16"]), check_hf=False)
