"""Quantize on refit: whichever way the trainer's weights reach the rollout engine (an FP8 checkpoint on
disk, rollout.weight_sync=disk under contract.quant=fp8_block; the master weights over the weight-update
group, rollout.weight_sync=distributed), the e4m3 weights and block scales the engine's linears run are,
bit for bit, the ones the trainer's fake quantization makes of its master weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.fp8_block import quantize_weight_blocks
from tonpolicy.model import Qwen3
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.model.fp8_checkpoint import is_quantized_linear
from tonpolicy.rollout.engine import Engine
from tonpolicy.rollout.server.model import load_checked, reload_weights

CFG = replace(ModelConfig(), num_layers=1, vocab_size=300)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _engine(dtype: torch.dtype) -> Engine:
    return Engine(Qwen3(CFG, get_kernels("plain"), dtype, init_state_dict(CFG, dtype, 0)), max_running_requests=1)


def _held(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_the_rollout_runs_the_trainers_quantization(tmp_path: Path, dtype: torch.dtype, sync: str) -> None:
    trained = init_state_dict(CFG, dtype, 7)  # the trainer's master weights after an update
    engine = _engine(dtype)
    if sync == "disk":
        save_hf(trained, CFG, tmp_path / "step_1", quant="fp8_block")
        reload_weights(engine, str(tmp_path / "step_1"), CFG)
    else:
        load_checked(engine, trained, CFG, "the update")
    held = _held(engine)
    linears = [k for k in trained if is_quantized_linear(k, trained[k].shape)]
    assert len(linears) == 7
    for name, master in trained.items():
        if name in linears:
            (tq, ts), (rq, rs) = quantize_weight_blocks(master), quantize_weight_blocks(held[name])
            assert torch.equal(_bits(tq), _bits(rq)) and torch.equal(_bits(ts), _bits(rs)), name
        else:  # embeddings and norms travel as they are
            assert torch.equal(_bits(held[name]), _bits(master)), name
    if sync == "disk" and dtype == torch.bfloat16:
        # Control: the engine does not hold the master weights (the checkpoint keeps only their FP8
        # form), so the equality above is of the quantization, which is what the contract runs.
        assert any(not torch.equal(held[k], trained[k]) for k in linears)
