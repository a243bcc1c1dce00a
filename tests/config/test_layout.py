"""The one Layout: built once from the config, it owns the derived sizes, the label and the layout
rules, and the process groups, Megatron's arguments, the plan and the schedule's padding take its
values; a new kind of parallelism declared on it reaches both Megatron's groups and its config."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.errors import ConfigIssue
from tonpolicy.config.layout import Layout
from tonpolicy.config.names import layout_label
from tonpolicy.config.sizes import padded_seq_len, seq_pad_multiple
from tonpolicy.contract.megatron_args import transformer_kwargs
from tonpolicy.launch.plan import megatron_config
from tonpolicy.validation.validate import ConfigError, validate

BROKEN = [
    "parallel.tp=3",  # divides neither head count
    "parallel.pp=3",  # does not divide 4 layers
    "parallel.cp=2",  # with cp_type none
    "trainer.nproc_per_node=5",
]


def test_sizes_and_label_from_the_config() -> None:
    cfg = compose_config(["parallel=pp2", "parallel.pp_layers=[3,1]", "parallel.dp=2", "parallel.tp=2"])
    layout = Layout.from_config(cfg)
    assert (layout.world_size, layout.label, layout.stage_layers(cfg.model.num_layers)) == (
        8,
        "tp2_pp2_3-1_dp2",
        [3, 1],
    )
    assert layout_label(cfg.parallel) == layout.label == str(layout)
    assert Layout.of(layout.to_parallel()) == layout and layout.to_parallel().name == layout.label


def test_plan_and_megatron_args_take_the_layout_s_sizes() -> None:
    cfg = compose_config(["parallel=tp2_pp2", "contract.dtype=float32"])
    layout, megatron = Layout.from_config(cfg), megatron_config(cfg)
    tc = megatron["transformer_config"]
    assert {k: tc[k] for k in layout.megatron_sizes} == layout.megatron_sizes
    assert megatron["parallel_state"]["world_size"] == layout.world_size == 4
    assert megatron["schedule"]["seq_pad_multiple"] == layout.pad_multiple(cfg.contract.attention_tile) == 1
    ring = compose_config(["parallel=cp2_ring"])
    pad = Layout.from_config(ring).pad_multiple(ring.contract.attention_tile)
    assert pad == seq_pad_multiple(ring) == 4 * ring.contract.attention_tile and padded_seq_len(ring) % pad == 0


@pytest.mark.parametrize(
    ("cp", "cp_type", "multiple"), [(1, "none", 1), (2, "ulysses", 2), (2, "ring", 32), (4, "ring", 64)]
)
def test_pad_multiple_is_the_cp_split_s(cp: int, cp_type: str, multiple: int) -> None:
    """Ring CP cuts a sequence into 2*cp chunks of whole tiles, Ulysses into cp (the plan's padded length
    and the trainer's schedule both pad to it)."""
    assert Layout(cp=cp, cp_type=cp_type).pad_multiple(8) == multiple


def test_every_rule_at_once_with_key_value_and_rule() -> None:
    cfg = compose_config(BROKEN)
    issues = Layout.from_config(cfg).issues(cfg)
    assert {i.key for i in issues} == {"parallel.tp", "parallel.pp", "parallel.cp_type", "trainer.nproc_per_node"}
    assert ConfigIssue("parallel.pp", 3, "must divide model.num_layers=4 (or declare parallel.pp_layers)") in issues
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_hf=False)
    assert all(i in e.value.issues for i in issues)  # validation reports the layout's rules as they are
    assert Layout.from_config(compose_config([])).issues(compose_config([])) == []  # the control


def test_zero_sizes_are_left_to_the_positive_check() -> None:
    cfg = compose_config(["parallel.tp=0"])
    assert Layout.from_config(cfg).issues(cfg) == []


@dataclass(frozen=True)
class WithExpertTP(Layout):
    """A new kind of parallelism, declared on the Layout only: Megatron's expert tensor parallelism."""

    etp: int = 1

    @property
    def megatron_sizes(self) -> dict[str, int]:
        return {**super().megatron_sizes, "expert_tensor_parallel_size": self.etp}


def test_a_layout_kind_reaches_megatron_s_groups_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's group setup stands in as modules that record what they are given (no megatron import)."""
    from tonpolicy.trainer import cpu_compat, process_groups

    taken: dict[str, Any] = {}
    groups = types.SimpleNamespace(initialize_model_parallel=lambda **kw: taken.update(kw))
    seeds = types.SimpleNamespace(model_parallel_cuda_manual_seed=lambda *a, **kw: None)
    monkeypatch.setitem(sys.modules, "megatron.core", types.SimpleNamespace(parallel_state=groups))
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel", seeds)
    monkeypatch.setattr(process_groups.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cpu_compat, "apply", lambda: None)
    layout = WithExpertTP(tp=2, etp=2)
    process_groups.init_distributed(layout)
    assert taken == layout.megatron_sizes and taken["expert_tensor_parallel_size"] == 2
    model = compose_config([]).model
    assert transformer_kwargs(model, "float32", layout, True)["expert_tensor_parallel_size"] == 2
    assert "expert_tensor_parallel_size" not in transformer_kwargs(model, "float32", Layout(tp=2), True)  # control
