"""Resuming a run from a saved step (checkpoint.resume): which directory, whether it may be resumed here,
and what the trainer does before its first resumed step (the step records after the saved step
dropped, the servers brought to the saved weights' version)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tonpolicy.config.names import layout_label
from tonpolicy.config.schema import Config
from tonpolicy.trainer.optimizer_state import TRAINER_STATE, read_trainer_state


def saved_steps(run_dir: Path) -> list[Path]:
    """The run's saved steps that can be resumed (weights and trainer state), oldest first."""
    found = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def resume_dir(cfg: Config, run_dir: Path) -> tuple[Path | None, str | None]:
    """The step directory to resume from (None: start fresh), or the reason it cannot be resumed."""
    want = cfg.checkpoint.resume
    if want is None:
        return None, None
    if want == "auto":
        steps = saved_steps(run_dir)
        if not steps:
            return None, None
        path = steps[-1]
    else:
        path = Path(want)
        if not (path / TRAINER_STATE).is_file():
            return None, f"no {TRAINER_STATE} in {path}: give a step_<k> directory a run saved"
    if cfg.experiment.max_staleness:
        return None, "asynchronous steps (experiment.max_staleness > 0) cannot be resumed bit for bit yet"
    meta = read_trainer_state(path)
    saved, here = meta.get("layout"), layout_label(cfg.parallel)
    if saved != here:
        return None, (
            f"{path} was saved at layout {saved}, this run is {here}: the gradients' reduction order differs "
            "between layouts, so the resumed run would not be bit-identical to one that went on; resume "
            "at the saved layout"
        )
    if int(meta["completed_steps"]) >= cfg.experiment.steps:
        return None, f"{path} has {meta['completed_steps']} steps done, experiment.steps={cfg.experiment.steps}"
    return path, None


def drop_records_from(run_dir: Path, step: int) -> None:
    """Keep only the records of steps before `step` (they are made again, the same, by the resumed run)."""
    for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
        path = run_dir / name
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < step]
            path.write_text("".join(line + "\n" for line in kept))


def bring_servers_to(loop: Any, checkpoint: str, completed: int) -> None:
    """The servers started from the saved weights; make them report the saved step's version, as the
    uninterrupted run's did (a load of the same weights, under that version's name)."""
    from tonpolicy.loop.weight_sync import DiskWeightSync, weight_version

    if isinstance(loop.weights, DiskWeightSync):
        if loop.rank0:
            loop.server.update_weights_from_disk(checkpoint, weight_version=weight_version(completed - 1))
            loop.weights.version = weight_version(completed - 1)
        return
    loop.weights.export(loop.worker, completed - 1)
    if loop.rank0:
        loop.weights.push(completed - 1)
