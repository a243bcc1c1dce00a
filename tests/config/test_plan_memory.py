"""Plan mode's trainer memory per rank (`memory_per_rank`): the published parameter counts at one
rank, and the fullest rank's share at a real layout (dense / TP, experts / (TP * EP), layers / PP)."""

from __future__ import annotations

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.memory import GIB, memory_per_rank


def test_one_rank_holds_the_published_parameter_count() -> None:
    mem = memory_per_rank(compose_config(["model=qwen3_30b_a3b"]))
    assert round(mem["parameters"] / 1e9, 1) == 30.5  # Qwen3-30B-A3B
    assert mem["param_gib"] == pytest.approx(mem["parameters"] * 2 / GIB)  # bf16
    assert mem["total_gib"] == pytest.approx(mem["parameters"] * (2 + 4 + 12) / GIB)


def test_tp2_ep8_on_two_nodes() -> None:
    one = memory_per_rank(compose_config(["model=qwen3_30b_a3b"]))
    cfg = compose_config(["model=qwen3_30b_a3b", "parallel.tp=2", "parallel.ep=8", "parallel.dp=8", "trainer.nnodes=2"])
    mem = memory_per_rank(cfg)
    assert mem["expert_parameters"] == one["expert_parameters"] // 16
    dense = one["parameters"] - one["expert_parameters"]
    # Norms and routers (48 x 128 x 2048) are replicated; every other dense weight halves at TP=2.
    assert dense // 2 < mem["parameters"] - mem["expert_parameters"] < dense // 2 + 10_000_000
    assert mem["total_gib"] < 48  # fits an 80 GB GPU with room for activations


def test_pipeline_stages_split_layers() -> None:
    one = memory_per_rank(compose_config(["model=qwen3_235b_a22b", "parallel.ep=8", "parallel.dp=8"]))
    two = memory_per_rank(compose_config(["model=qwen3_235b_a22b", "parallel.ep=8", "parallel.dp=8", "parallel.pp=2"]))
    assert 0.45 < two["parameters"] / one["parameters"] < 0.55
