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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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


def save_trainer_state(worker: Any, path: Path, completed_steps: int) -> None:
    """`worker`'s optimizer state, merged to HF names on rank 0, into `path`/TRAINER_STATE (a collective)."""
    from safetensors.torch import save_file

    from tonpolicy.config.names import layout_label

    if worker.optimizer is None:
        worker._setup_optimizer()
    local, adam_step = local_state(worker.module, worker.optimizer)
    merged = {kind: worker.hf_state_dict(tensors) for kind, tensors in local.items()}
    if dist.get_rank() == 0:
        flat = {f"{kind}/{name}": t.contiguous() for kind, sd in merged.items() for name, t in sd.items()}
        meta = {
            "completed_steps": str(completed_steps),
            "adam_step": str(adam_step),
            "layout": layout_label(worker.cfg.parallel),
        }
        save_file(flat, str(path / TRAINER_STATE), metadata=meta)
    dist.barrier()


def load_trainer_state(worker: Any, path: Path, optimizer: bool = True) -> int:
    """Restore the state `save_trainer_state` wrote, split for this rank's layout; returns the steps the
    run had completed. `optimizer=False`: that count only (a test's control)."""
    from safetensors import safe_open

    from tonpolicy.families import megatron_weights
    from tonpolicy.kernels import weights_updated

    if worker.optimizer is None:
        worker._setup_optimizer()
    with safe_open(str(path / TRAINER_STATE), framework="pt") as f:
        meta = f.metadata()
        flat = {k: f.get_tensor(k) for k in f.keys()} if optimizer else {}  # noqa: SIM118 - no __iter__
    if optimizer:
        local = {}
        for kind in KINDS:
            hf = {k.partition("/")[2]: t for k, t in flat.items() if k.startswith(kind + "/")}
            local[kind] = megatron_weights(worker.model_cfg.family).megatron_state(
                hf, worker.model_cfg, worker.vocab_padded, worker.layout.pp_layers
            )
        load_local_state(worker.module, worker.optimizer, local, int(meta["adam_step"]))
        weights_updated()  # an fp32 model's main parameters are its weights
    return int(meta["completed_steps"])
