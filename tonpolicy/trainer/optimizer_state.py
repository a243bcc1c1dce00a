"""The trainer's state beside a saved checkpoint's weights, from which checkpoint.resume continues a run.

`trainer_state/` is the optimizer's state in megatron-core's distributed checkpoint format (Adam's
exp_avg and exp_avg_sq, a bf16 model's fp32 main parameters, the Adam step): each tensor saved as the
shards of its global tensor, so a run at any TP/PP layout loads its own shards of it. The weights are
the checkpoint's HF files. `trainer_state.json`, written last, marks the step resumable and says what
resume checks before start (the steps completed, the layout that saved it). The data position and the
policy versions follow from the steps completed (the prompt order is a pure function of seed, epoch and
position; a step's version is its number); the trainer draws no random numbers of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TRAINER_STATE = "trainer_state.json"  # beside a saved checkpoint's weights, written last
OPTIMIZER_DIR = "trainer_state"  # megatron's distributed checkpoint of the optimizer, beside it


def read_trainer_state(path: Path) -> dict[str, Any]:
    """What `save_trainer_state` recorded about the saved step in `path`."""
    return json.loads((path / TRAINER_STATE).read_text())


def _chained(optimizer: Any) -> list[Any]:
    # a MoE model's experts have an optimizer of their own (how many depends on the layout)
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _tensors_only(entry: Any) -> Any:
    """A megatron optimizer's sharded state dict with only its ShardedTensors saved: the rest (the
    param groups' hyperparameters, the per-layout optimizer nesting) is the run's own, restored from
    the running optimizer, so that any layout's optimizers load the same tensors."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(entry, dict):
        return {k: _tensors_only(v) for k, v in entry.items() if k != "common_step"}  # the step: TRAINER_STATE
    if isinstance(entry, list):
        return [_tensors_only(v) for v in entry]
    return entry if isinstance(entry, ShardedBase | LocalNonpersistentObject) else LocalNonpersistentObject(entry)


def sharded_optimizer_state(worker: Any, is_loading: bool) -> dict[str, Any]:
    """`worker`'s optimizer state as megatron ShardedTensors (what is saved, or what is loaded into:
    is_loading gives a fresh optimizer zero Adam state first, so that it names the tensors to load)."""
    model = worker.module.sharded_state_dict()
    return {"optimizer": [_tensors_only(o.sharded_state_dict(model, is_loading)) for o in _chained(worker.optimizer)]}


def _adam_step(optimizer: Any) -> float:
    """The Adam step count (megatron keeps one for all parameters); 0 before the first update."""
    return next((float(s["step"]) for o in _chained(optimizer) for s in o.optimizer.state.values() if "step" in s), 0.0)


def save_trainer_state(worker: Any, path: Path, completed_steps: int) -> None:
    """`worker`'s optimizer state into `path`/OPTIMIZER_DIR, then `path`/TRAINER_STATE (a collective)."""
    from tonpolicy.config.names import layout_label
    from tonpolicy.trainer import dist_checkpoint

    if worker.optimizer is None:
        worker._setup_optimizer()
    step = _adam_step(worker.optimizer)  # 0: every update so far refused, no Adam state yet
    dist_checkpoint.save(sharded_optimizer_state(worker, is_loading=False), path / OPTIMIZER_DIR)
    if dist.get_rank() == 0:
        layout = layout_label(worker.cfg.parallel)
        meta = {"completed_steps": completed_steps, "layout": layout, "adam_step": step}
        (path / TRAINER_STATE).write_text(json.dumps(meta) + "\n")
    dist.barrier()


def load_trainer_state(worker: Any, path: Path, optimizer: bool = True) -> int:
    """Restore the state `save_trainer_state` wrote, resharded to this rank's layout; returns the steps
    the run had completed. `optimizer=False`: that count only (a test's control)."""
    from tonpolicy.trainer import dist_checkpoint

    meta = read_trainer_state(path)
    if worker.optimizer is None:
        worker._setup_optimizer()
    if optimizer and meta["adam_step"] > 0:
        loaded = dist_checkpoint.load(sharded_optimizer_state(worker, is_loading=True), path / OPTIMIZER_DIR)
        for opt, state in zip(_chained(worker.optimizer), loaded["optimizer"], strict=True):
            torch_state = state.get("optimizer", state)  # a bf16 model's holds it beside its main params
            torch_state["state"]["common_step"] = torch.tensor(meta["adam_step"], dtype=torch.float32)
            opt.load_state_dict(state)
    return int(meta["completed_steps"])
