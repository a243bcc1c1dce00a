"""Validation rules for released SGLang (rollout=sglang): what the contract needs inside it, what its
CPU engine accepts. Called by tonpolicy.validation.validate with its `bad(key, rule)` reporter."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tonpolicy.config.device import resolve_device
from tonpolicy.config.schema import Config
from tonpolicy.kernels.sets import kernel_set, kernel_set_names

PYTHON_ENV = "TONPOLICY_SGLANG_PYTHON"
VENV = ".venv-sglang"
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# The model package that carries the contract into released SGLang.
CONTRACT_SGLANG_PACKAGE = "tonpolicy.inside_sglang.model"


def check_sglang(cfg: Config, bad: Any) -> None:
    """Rules for released SGLang: what the contract needs inside it, what its CPU engine accepts."""
    c, pol = cfg.contract, cfg.contract.sglang
    invariant = c.kernels in kernel_set_names() and kernel_set(c.kernels).invariant
    if invariant and pol.model_package != CONTRACT_SGLANG_PACKAGE:
        bad(
            "contract.sglang.model_package",
            f"contract {c.name} runs its kernels inside SGLang only through "
            f"{CONTRACT_SGLANG_PACKAGE!r}; SGLang's own kernels cannot reproduce its bits",
        )
    if not invariant and pol.model_package:
        bad("contract.sglang.model_package", f"kernel set {c.kernels!r} is stock SGLang's: must be null")
    if pol.model_package:
        if pol.enable_deterministic_inference:
            bad(
                "contract.sglang.enable_deterministic_inference",
                "must be false with the model package: its "
                "kernels are invariant by construction, and SGLang's deterministic mode swaps the sampler, "
                "turns the radix cache off and refuses the CPU attention backend",
            )
        if pol.rl_on_policy_target is not None:
            bad(
                "contract.sglang.rl_on_policy_target",
                "must be null with the model package: SGLang would round the returned logprobs to bf16",
            )
    if resolve_device(cfg) == "cpu":
        if pol.attention_backend not in (None, "torch_native"):
            bad(
                "contract.sglang.attention_backend",
                "SGLang's CPU engine on a CPU without AMX runs only torch_native (or null)",
            )
        if pol.enable_deterministic_inference:
            bad("contract.sglang.enable_deterministic_inference", "SGLang's deterministic mode needs an accelerator")
    _check_fp8_checkpoint(cfg, bad)
    if cfg.mode == "run":
        py = sglang_python(cfg)
        if os.sep in py and not os.access(py, os.X_OK):
            bad(
                "rollout.python",
                f"{py} is not an executable interpreter; make the SGLang environment with "
                "`bash scripts/setup_sglang.sh` or point rollout.python at one",
            )


def _check_fp8_checkpoint(cfg: Config, bad: Any) -> None:
    """Released SGLang reads a published FP8 checkpoint (`quantization_config` in config.json) into its
    Fp8Config, which it refuses to run in float32 (its FP8 method takes bf16/fp16 activations only), and
    whose linear method on CPU (stock SGLang's own model) needs AMX and sgl_kernel's CPU build."""
    if not cfg.model.checkpoint:
        return
    try:
        qc = json.loads((Path(cfg.model.checkpoint) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return  # a missing or unreadable config.json is reported by the checkpoint's own rules
    if not qc:
        return
    if cfg.contract.dtype == "float32":
        bad(
            "contract.dtype",
            f"model.checkpoint={cfg.model.checkpoint} is an FP8 checkpoint (quantization_config in its "
            "config.json), which released SGLang refuses to serve in float32: use contract.dtype=bfloat16, or "
            "an unquantized checkpoint (e.g. one saved by tonpolicy without quant) for float32",
        )
    device = resolve_device(cfg)
    if not cfg.contract.sglang.model_package and device == "cpu":
        bad(
            "model.checkpoint",
            f"an FP8 checkpoint (quantization_config in its config.json) served by stock SGLang "
            f"(contract={cfg.contract.name}: contract.sglang.model_package=null) with trainer.device={device}: "
            "SGLang's FP8 linear on CPU needs AMX and sgl_kernel's CPU ops (convert_weight_packed), which "
            "PyPI's sgl-kernel does not ship, so it fails at load; use the contract's model package "
            "(the default contract), a CUDA device, or an unquantized checkpoint",
        )


def sglang_python(cfg: Config) -> str:
    """The interpreter of the SGLang environment (see RolloutConfig.python)."""
    if cfg.rollout.python:
        return cfg.rollout.python
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    for root in (SOURCE_ROOT, Path.cwd()):
        candidate = root / VENV / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return sys.executable
