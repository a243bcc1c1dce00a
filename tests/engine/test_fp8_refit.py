"""Quantize on refit: under contract.quant=fp8_block both engines quantize the master weights with the one
function (`tonpolicy.kernels.fp8_block`, per canonical K-shard for the row-parallel linears), so the weight
sync carries the master weights, by disk (an HF checkpoint) or over the weight-update group, and the e4m3
weights and block scales the rollout runs are, bit for bit, those of the trainer's fake quantization.

The control shows why the sync does not carry FP8 files: the published format has one block grid per
weight, and where a row-parallel linear's canonical K-shards are not whole 128-column blocks (the tiny
model's o_proj and down_proj), re-quantizing the dequantized file per shard changes the bits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.invariant.ordered_fp8 import QuantizedWeight, quantize_weight
from tonpolicy.model import Qwen3
from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
from tonpolicy.model.fp8_checkpoint import is_quantized_linear
from tonpolicy.rollout.engine import Engine
from tonpolicy.rollout.server.model import load_checked, reload_weights

CFG = replace(ModelConfig(), num_layers=1, vocab_size=300)
SHARDS = 4  # contract.canonical_shards' default: o_proj's K 256 -> 64-column shards, down_proj's 384 -> 96
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _quantized(name: str, w: torch.Tensor) -> list[QuantizedWeight]:
    """A weight as the fp8_block linears quantize it: per canonical K-shard where it is row-parallel."""
    shards = SHARDS if name.endswith(ROW_PARALLEL) else 1
    width = w.shape[1] // shards
    return [quantize_weight(w[:, c * width : (c + 1) * width]) for c in range(shards)]


def _same(a: list[QuantizedWeight], b: list[QuantizedWeight]) -> bool:
    return all(
        torch.equal(_bits(x.row_scales), _bits(y.row_scales))
        and all(
            (g is None and h is None) or (g is not None and h is not None and torch.equal(_bits(g), _bits(h)))
            for g, h in ((x.full, y.full), (x.tail, y.tail))
        )
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_the_rollout_runs_the_trainers_quantization(tmp_path: Path, dtype: torch.dtype, sync: str) -> None:
    kernels = get_kernels("ordered", quant="fp8_block")
    engine = Engine(Qwen3(CFG, kernels, dtype, init_state_dict(CFG, dtype, 0)), max_running_requests=1)
    trained = init_state_dict(CFG, dtype, 7)  # the trainer's master weights after an update (HF names)
    if sync == "disk":
        save_hf(trained, CFG, tmp_path / "step_1")
        reload_weights(engine, str(tmp_path / "step_1"), CFG)
    else:
        load_checked(engine, trained, CFG, "the update")
    held = {k: v.detach() for k, v in engine.model.state_dict().items()}
    linears = [k for k in trained if is_quantized_linear(k, trained[k].shape)]
    assert len(linears) == 7
    for name, master in trained.items():
        assert torch.equal(_bits(held[name]), _bits(master)), name
        if name in linears:
            assert _same(_quantized(name, held[name]), _quantized(name, master)), name


def test_an_fp8_file_on_the_refit_path_would_change_the_row_parallel_bits(tmp_path: Path) -> None:
    trained = init_state_dict(CFG, torch.bfloat16, 7)
    save_hf(trained, CFG, tmp_path / "fp8", quant="fp8_block")
    _, read = load_hf(tmp_path / "fp8", torch.bfloat16)
    linears = [k for k in trained if is_quantized_linear(k, trained[k].shape)]
    changed = {k for k in linears if not _same(_quantized(k, read[k]), _quantized(k, trained[k]))}
    # Whole-block linears come back to the same bits; the 64- and 96-column shards do not.
    assert changed == {k for k in linears if k.endswith(ROW_PARALLEL)}
