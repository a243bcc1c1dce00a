"""Validation of Qwen3-MoE profiles and expert parallelism: every rule named at once, and the HF
config.json cross-check field by field (both expert-count names; dense vs MoE refused either way)."""

from __future__ import annotations

import json

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.config.hf_qwen3_moe import config_to_hf
from tonpolicy.validation.validate import ConfigError, validate


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides), check_hf=True)
    return str(info.value)


def test_every_moe_rule_at_once() -> None:
    text = _problems(
        [
            "model=qwen3_moe_tiny",
            "model.num_experts_per_tok=9",
            "model.mlp_only_layers=[1,7]",
            "parallel.ep=3",
            "parallel.dp=3",
            "parallel.rollout_tp=5",
            "+trainer.moe_capacity_factor=1.25",
        ]
    )
    assert "model.num_experts_per_tok=9: must be in [1, model.num_experts=8]" in text
    assert "model.mlp_only_layers=[1, 7]: layers [7] are outside [0, model.num_layers=4)" in text
    assert "parallel.ep=3: must divide model.num_experts=8" in text
    assert "parallel.rollout_tp=5: must divide model.moe_intermediate_size=96" in text
    assert "trainer.moe_capacity_factor=1.25: contract qwen3_moe_v2 is dropless" in text


def test_ep_is_carved_out_of_data_parallel_ranks() -> None:
    text = _problems(["model=qwen3_moe_tiny", "parallel.ep=2"])
    assert "parallel.ep=2: Megatron carves EP out of the data-parallel ranks" in text
    validate(compose_config(["model=qwen3_moe_tiny", "parallel.ep=2", "parallel.dp=2"]), check_hf=False)


def test_ep_on_a_dense_model_is_refused() -> None:
    text = _problems(["parallel.ep=2", "parallel.dp=2"])
    assert "parallel.ep=2: expert parallelism needs a mixture of experts; model qwen3_tiny is dense" in text


def test_dense_family_with_experts_and_moe_family_without() -> None:
    assert "family qwen3 is dense: must be 0" in _problems(["model.num_experts=8"])
    assert "is a mixture of experts: must be a positive integer" in _problems(
        ["model=qwen3_moe_tiny", "model.num_experts=0"]
    )


def test_capacity_factor_allowed_off_policy() -> None:
    validate(
        compose_config(["model=qwen3_moe_tiny", "contract=off_policy", "+trainer.moe_capacity_factor=1.25"]),
        check_hf=False,
    )


@pytest.mark.parametrize("count_key", ["num_experts", "num_local_experts"])
def test_hf_config_cross_check_field_by_field(tmp_path, count_key: str) -> None:
    cfg = compose_config(["model=qwen3_30b_a3b"])
    hf = config_to_hf(cfg.model, "bfloat16")
    hf.pop("num_experts"), hf.pop("num_local_experts")
    hf[count_key] = 128
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    validate(compose_config(["model=qwen3_30b_a3b", f"model.hf_config={path}"]))
    hf |= {count_key: 64, "moe_intermediate_size": 512, "norm_topk_prob": False, "mlp_only_layers": [3]}
    path.write_text(json.dumps(hf))
    text = _problems(["model=qwen3_30b_a3b", f"model.hf_config={path}"])
    assert f"model.num_experts=128: model.hf_config has {count_key}=64" in text
    assert "model.moe_intermediate_size=768: model.hf_config has moe_intermediate_size=512" in text
    assert "model.norm_topk_prob=True: model.hf_config has norm_topk_prob=False" in text
    assert "model.mlp_only_layers=[]: model.hf_config has mlp_only_layers=[3]" in text


def test_dense_config_json_under_a_moe_profile_is_refused(tmp_path) -> None:
    from tonpolicy.config.hf_qwen3 import config_to_hf as dense_to_hf

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dense_to_hf(compose_config(["model=qwen3_4b"]).model)))
    text = _problems(["model=qwen3_30b_a3b", f"model.hf_config={path}"])
    assert "a dense architecture: use a dense profile" in text
    moe = config_to_hf(compose_config(["model=qwen3_30b_a3b"]).model)
    path.write_text(json.dumps(moe))
    assert "a MoE architecture: use a MoE profile" in _problems(["model=qwen3_4b", f"model.hf_config={path}"])


def test_rollout_ep_is_sglangs_ep_size_inside_its_tp() -> None:
    from tonpolicy.launch.plan import sglang_argv

    text = _problems(["model=qwen3_moe_tiny", "parallel.rollout_ep=2"])
    assert "parallel.rollout_ep=2: the embedded rollout engine runs unsharded" in text
    assert "parallel.rollout_ep=2: SGLang places EP inside TP: must divide parallel.rollout_tp=1" in text
    text = _problems(["model=qwen3_moe_tiny", "rollout=sglang", "parallel.rollout_tp=2", "parallel.rollout_ep=3"])
    assert "parallel.rollout_ep=3: must divide model.num_experts=8" in text
    assert "expert parallelism needs a mixture of experts" in _problems(["parallel.rollout_ep=2"])
    cfg = compose_config(["model=qwen3_moe_tiny", "rollout=sglang", "parallel.rollout_tp=2", "parallel.rollout_ep=2"])
    validate(cfg, check_hf=False)
    argv = sglang_argv(cfg, "/ckpt")
    assert argv[argv.index("--ep-size") + 1] == "2" and argv[argv.index("--tp-size") + 1] == "2"
