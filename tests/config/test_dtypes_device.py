"""One dtype map and one resolution of trainer.device=auto, for every room."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.config.device import resolve_device
from tonpolicy.config.dtypes import DTYPES, dtype_name, torch_dtype


def test_names_and_dtypes_are_inverse() -> None:
    assert all(dtype_name(torch_dtype(name)) == name for name in DTYPES)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        torch_dtype("fp8")
    with pytest.raises(ValueError, match="no name for dtype"):
        dtype_name(torch.float64)


def test_auto_follows_this_process_gpu_and_explicit_devices_stay() -> None:
    assert resolve_device(compose_config(["trainer.device=cpu"])) == "cpu"
    assert resolve_device(compose_config(["trainer.device=cuda"])) == "cuda"
    assert resolve_device(compose_config(["trainer.device=auto"])) == ("cuda" if torch.cuda.is_available() else "cpu")
