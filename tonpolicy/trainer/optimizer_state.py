"""The optimizer's state in HF parameter names, so that a run resumes it at any layout.

Megatron's Adam keeps, per parameter, an fp32 main copy (a bf16 model's master weights; an fp32
model's parameter itself) and its exp_avg and exp_avg_sq. Each is a tensor of the parameter's shape,
so the weights' own gather (megatron_to_hf) and split (hf_to_megatron) move them between layouts:
the saved file holds whole tensors, `main/<hf name>`, `exp_avg/<hf name>` and `exp_avg_sq/<hf name>`,
and the Adam step count. Padded vocabulary rows never get a gradient, so their state is zero and is
rebuilt as zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

KINDS = ("main", "exp_avg", "exp_avg_sq")
TRAINER_STATE = "trainer_state.safetensors"  # beside a saved checkpoint's weights


def main_params(optimizer: Any) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, torch.optim.Optimizer]]:
    """(model parameter, its fp32 main parameter, the torch optimizer holding its state) for each."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "float16_groups"):  # a bf16 model: fp32 master copies
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                yield from ((p, m, opt.optimizer) for p, m in zip(model_group, main_group, strict=True))
            for group in opt.fp32_from_fp32_groups:
                yield from ((p, p, opt.optimizer) for p in group)
        else:
            for group in opt.optimizer.param_groups:
                yield from ((p, p, opt.optimizer) for p in group["params"])


def local_state(module: torch.nn.Module, optimizer: Any) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """This rank's state by Megatron parameter name, per kind, and the Adam step count."""
    names = {id(p): name for name, p in module.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    step = 0
    for p, main, opt in main_params(optimizer):
        state = opt.state.get(main, {})
        name = names[id(p)]
        out["main"][name] = main.detach().float().cpu().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[k][name] = state[k].detach().cpu().clone() if k in state else torch.zeros_like(out["main"][name])
        if "step" in state:
            step = int(state["step"])
    return out, step


def load_local_state(
    module: torch.nn.Module, optimizer: Any, state: dict[str, dict[str, torch.Tensor]], step: int
) -> None:
    """Set this rank's main parameters and Adam state from Megatron-named tensors (`local_state`'s form)."""
    names = {id(p): name for name, p in module.named_parameters()}
    for p, main, opt in main_params(optimizer):
        name = names[id(p)]
        with torch.no_grad():
            main.copy_(state["main"][name].to(main.dtype))
        opt.state[main] = {
            "step": torch.tensor(float(step)),
            "exp_avg": state["exp_avg"][name].to(main.dtype).clone(),
            "exp_avg_sq": state["exp_avg_sq"][name].to(main.dtype).clone(),
        }
