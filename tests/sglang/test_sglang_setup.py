"""scripts/sglang_cpu_requirements.py: SGLang's pinned requirements, less only its CUDA-only kernels."""

from __future__ import annotations

import importlib.util
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sglang_cpu_requirements.py"


def _load():
    spec = importlib.util.spec_from_file_location("sglang_cpu_requirements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keeps_sglang_pins_and_drops_only_the_cuda_kernels() -> None:
    module = _load()
    kept = [Requirement(line) for line in module.cpu_requirements()]
    names = {canonicalize_name(r.name) for r in kept}
    # SGLang's own pins come through unchanged (the torch build both engines share).
    assert "torch==2.14.1" in {str(r) for r in kept}
    assert {"transformers", "fastapi", "torchvision"} <= names
    assert not names & module.CUDA_ONLY
    assert all(r.marker is None for r in kept)
    # Every name left out is one SGLang really asks for (a stale entry would hide a rename), and
    # nothing else of SGLang's unconditional requirements is dropped.
    declared = {}
    for line in requires("sglang") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            declared[canonicalize_name(req.name)] = req
    assert module.CUDA_ONLY <= set(declared), module.CUDA_ONLY - set(declared)
    assert names == set(declared) - module.CUDA_ONLY
