"""The trainer checks what it loads: a checkpoint whose architecture is not the run's model profile is
refused with every differing field named (the server does the same, tests/server/test_server_process.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.trainer.process_groups import spawn


def build_or_refuse(checkpoint: str) -> str:
    from tonpolicy.config.schema import Config
    from tonpolicy.trainer.worker import TrainerWorker

    try:
        TrainerWorker(Config(), checkpoint).close()
    except ValueError as e:
        return str(e)
    return "built"


def test_trainer_refuses_another_architecture(tmp_path: Path) -> None:
    other = ModelConfig(num_layers=3, intermediate_size=256)
    save_hf(init_state_dict(other, torch.float32, 0), other, tmp_path / "other")
    save_hf(init_state_dict(ModelConfig(), torch.float32, 0), ModelConfig(), tmp_path / "same")
    msg = spawn(build_or_refuse, 1, str(tmp_path / "other"))
    assert "another architecture" in msg and "'num_layers': (4, 3)" in msg and "intermediate_size" in msg, msg
    assert spawn(build_or_refuse, 1, str(tmp_path / "same")) == "built"
