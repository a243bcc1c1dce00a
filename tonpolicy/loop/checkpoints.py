"""Saved checkpoints: the trained weights as complete HF model directories under
<run dir>/checkpoints/step_<k> (k: steps completed, the weight version the servers report), every
checkpoint.save_every steps and after the last step, the newest checkpoint.keep_last of them kept.

With rollout.weight_sync=disk every step already writes such a directory for the servers to load: a saved
step keeps it, any other is deleted once the next step's weights are loaded. With the distributed sync the
saved steps are written here (every rank takes part in the gather). A saved step also holds the trainer's
state (the optimizer's, in megatron's distributed checkpoint format), from which checkpoint.resume continues
the run. Under contract.quant=fp8_block a saved step also holds, in `fp8/`, the same policy in the published
FP8 format (e4m3 linears with their `weight_scale_inv`), what an FP8 server loads; the step directory itself
keeps the master weights that training and resuming continue from."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.loop.weight_sync import weight_version

FP8_DIR = "fp8"  # a saved step's published-format FP8 model directory, under contract.quant=fp8_block


class Checkpoints:
    def __init__(self, cfg: Config, run_dir: Path, rank0: bool) -> None:
        self.root, self.rank0 = run_dir / "checkpoints", rank0
        self.every, self.keep = cfg.checkpoint.save_every, cfg.checkpoint.keep_last
        self.steps, self.disk = cfg.experiment.steps, cfg.rollout.weight_sync == "disk"
        self.quant = cfg.contract.quant
        self.saved: list[Path] = []

    def saves(self, completed: int) -> bool:
        return completed == self.steps or (self.every > 0 and completed % self.every == 0)

    def path(self, completed: int) -> Path:
        return self.root / weight_version(completed - 1)

    def after_step(self, worker: Any, step: int) -> None:
        """After step `step` (0-based) is trained and its weights pushed; on every rank."""
        completed = step + 1
        if self.saves(completed):
            if not self.disk:
                worker.save_hf(self.path(completed))  # a collective: rank 0 writes
            if self.quant == "fp8_block":
                worker.save_hf(self.path(completed) / FP8_DIR, quant=self.quant)
            worker.save_trainer_state(self.path(completed), completed)  # what a resumed run continues from
            self.saved.append(self.path(completed))
        if not self.rank0:
            return
        gone = self.saved[: -self.keep]
        self.saved = self.saved[-self.keep :]
        if self.disk and completed > 1 and not self.saves(completed - 1):
            gone.append(self.path(completed - 1))  # superseded: the servers now hold step `completed`
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
