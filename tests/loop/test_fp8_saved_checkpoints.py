"""Under contract.quant=fp8_block a saved step holds the master weights (what training and resuming
continue from) and, in `fp8/`, the same policy in the published FP8 format; a superseded step goes with it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.loop.checkpoints import FP8_DIR, Checkpoints
from tonpolicy.model.checkpoint import init_state_dict, save_hf

CFG = replace(ModelConfig(), num_layers=1, vocab_size=300)
MASTERS = init_state_dict(CFG, torch.bfloat16, 2)


class Worker:
    """TrainerWorker.save_hf's contract on one rank: its weights as an HF directory, in `quant`'s format."""

    def save_hf(self, path: Path, quant: str = "none") -> None:
        save_hf(MASTERS, CFG, path, quant=quant)

    def save_trainer_state(self, path: Path, completed: int) -> None:
        (path / "trainer_state.safetensors").touch()


@pytest.mark.parametrize("quant", ["fp8_block", "none"])
def test_saved_steps_hold_an_fp8_export_beside_the_masters(tmp_path: Path, quant: str) -> None:
    cfg = compose_config(
        ["rollout.weight_sync=distributed", "experiment.steps=3", "checkpoint.keep_last=1", f"contract.quant={quant}"]
    )
    checkpoints = Checkpoints(cfg, tmp_path, rank0=True)
    for step in range(3):
        checkpoints.after_step(Worker(), step)
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_3"]
    masters = load_file(str(root / "step_3" / "model.safetensors"))
    assert all(torch.equal(masters[k], v) for k, v in MASTERS.items() if k in masters)
    assert "quantization_config" not in json.loads((root / "step_3" / "config.json").read_text())
    export = root / "step_3" / FP8_DIR
    if quant == "none":
        assert not export.exists()
        return
    hf = json.loads((export / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "fp8"
    stored = load_file(str(export / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
