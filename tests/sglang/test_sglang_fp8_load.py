"""The contract package's reading of published FP8 checkpoints (tonpolicy.inside_sglang.model.fp8_load),
without a server: SGLang's weight stream with FP8 pairs in any order gives the master weights tonpolicy's
own loader gives, bit for bit; SGLang's quantization configs other than a published block-scaled FP8
checkpoint's are refused by name; validation refuses a float32 run of an FP8 checkpoint through SGLang
(SGLang refuses it itself, at start-up) and stock SGLang (contract=off_policy) on one on CPU (its FP8
linear needs AMX and sgl_kernel's CPU build). The served proof is
test_sglang_real.py::test_model_package_gives_the_contract_bits_bf16_tp2 (an FP8 checkpoint at TP 2)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.inside_sglang.model.fp8_load import check_quant_config, dequantized
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.model.fp8_checkpoint import dequantize_state_dict, quantization_config, quantize_state_dict
from tonpolicy.validation.validate import ConfigError, validate


@pytest.fixture(scope="module")
def fp8_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Master weights and their published FP8 form."""
    masters = init_state_dict(ModelConfig(), torch.bfloat16, 3)
    return masters, quantize_state_dict(masters)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("seed", [0, 1])
def test_stream_in_any_order_gives_the_loaders_masters(fp8_pair: tuple[dict, dict], seed: int) -> None:
    masters, fp8 = fp8_pair
    items = list(fp8.items())
    random.Random(seed).shuffle(items)  # scales before or after their weights, far apart
    got = dict(dequantized(items, torch.bfloat16, "ckpt"))
    want = dequantize_state_dict(fp8, torch.bfloat16, {}, "ckpt")
    assert set(got) == set(want) == set(masters)
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)
    # Control: the pairs are really read back (quantized), not passed through as the masters.
    assert any(not torch.equal(_bits(got[k]), _bits(masters[k])) for k in masters if k.endswith("_proj.weight"))


def test_unpaired_and_other_fp8_tensors_are_refused(fp8_pair: tuple[dict, dict]) -> None:
    _, fp8 = fp8_pair
    name = next(k for k in fp8 if k.endswith("q_proj.weight"))
    without_scale = [(k, v) for k, v in fp8.items() if k != name + "_scale_inv"]
    with pytest.raises(ValueError, match="weight_scale_inv is missing"):
        dict(dequantized(without_scale, torch.bfloat16, "ckpt"))
    without_weight = [(k, v) for k, v in fp8.items() if k != name]
    with pytest.raises(ValueError, match="has no weight"):
        dict(dequantized(without_weight, torch.bfloat16, "ckpt"))
    e5m2 = [(name, fp8[name].to(torch.float8_e5m2))]
    with pytest.raises(ValueError, match="only float8_e4m3fn"):
        dict(dequantized(e5m2, torch.bfloat16, "ckpt"))


def _sglang_fp8(serialized: bool = True, name: str = "fp8") -> SimpleNamespace:
    """The two things the package reads from SGLang's Fp8Config."""
    return SimpleNamespace(get_name=lambda: name, is_checkpoint_fp8_serialized=serialized)


def test_sglang_quant_configs() -> None:
    published = {"_name_or_path": "/m", "quantization_config": quantization_config()}
    check_quant_config(None, {})
    check_quant_config(_sglang_fp8(), published)
    with pytest.raises(ValueError, match="quantization 'awq'"):
        check_quant_config(_sglang_fp8(name="awq"), published)
    # `--quantization fp8` on an unquantized checkpoint would be SGLang's own online FP8: not the contract's.
    with pytest.raises(ValueError, match="contract.quant=fp8_block"):
        check_quant_config(_sglang_fp8(serialized=False), {})
    other = {**published, "quantization_config": {**quantization_config(), "weight_block_size": [64, 64]}}
    with pytest.raises(ValueError, match=r"/m/config.json: quantization_config.weight_block_size=\[64, 64\]"):
        check_quant_config(_sglang_fp8(), other)


def test_fp8_checkpoint_through_sglang_is_refused_where_sglang_cannot_serve_it(tmp_path: Path) -> None:
    cfg = ModelConfig()
    save_hf(init_state_dict(cfg, torch.bfloat16, 0), cfg, tmp_path / "fp8", quant="fp8_block")
    save_hf(init_state_dict(cfg, torch.bfloat16, 0), cfg, tmp_path / "plain")
    base = ["rollout=sglang", "trainer.device=cpu"]
    with pytest.raises(ConfigError, match=r"contract.dtype='float32': model.checkpoint=.*fp8 is an FP8 checkpoint"):
        validate(compose_config([*base, f"model.checkpoint={tmp_path / 'fp8'}", "contract.dtype=float32"]))
    # Stock SGLang's FP8 linear on CPU needs AMX and sgl_kernel's CPU build: it fails at load.
    stock = [*base, "contract=off_policy"]
    with pytest.raises(ConfigError, match=r"model.checkpoint='.*fp8': .*stock SGLang \(contract=off_policy.*cpu"):
        validate(compose_config([*stock, f"model.checkpoint={tmp_path / 'fp8'}"]))
    # Controls: bf16 with the FP8 checkpoint, and float32 with an unquantized one, pass; so does stock
    # SGLang on an unquantized checkpoint.
    validate(compose_config([*base, f"model.checkpoint={tmp_path / 'fp8'}", "contract.dtype=bfloat16"]))
    validate(compose_config([*base, f"model.checkpoint={tmp_path / 'plain'}", "contract.dtype=float32"]))
    validate(compose_config([*stock, f"model.checkpoint={tmp_path / 'plain'}"]))
