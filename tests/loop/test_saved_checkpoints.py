"""Which step checkpoints a run keeps: every checkpoint.save_every steps and the last step, the newest
checkpoint.keep_last of them; with the disk sync, every other per-step directory is deleted once the
next step's weights are loaded; with the distributed sync only the saved steps are written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.loop.checkpoints import Checkpoints


class DiskSync:
    """What DiskWeightSync.export does each step: the step's directory, written by the worker."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def export(self, step: int) -> None:
        (self.root / f"step_{step + 1}").mkdir(parents=True)


class Worker:
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_hf(self, path: Path) -> None:
        path.mkdir(parents=True)
        self.saved.append(path.name)

    def save_trainer_state(self, path: Path, completed: int) -> None:
        assert path.name == f"step_{completed}" and path.is_dir()
        (path / "trainer_state.safetensors").touch()


@pytest.mark.parametrize(
    ("sync", "save_every", "keep_last", "kept", "written_by_save"),
    [
        ("disk", 0, 2, ["step_7"], []),
        ("disk", 3, 2, ["step_6", "step_7"], []),
        ("disk", 2, 1, ["step_7"], []),
        ("distributed", 0, 2, ["step_7"], ["step_7"]),
        ("distributed", 3, 5, ["step_3", "step_6", "step_7"], ["step_3", "step_6", "step_7"]),
        ("distributed", 2, 2, ["step_6", "step_7"], ["step_2", "step_4", "step_6", "step_7"]),
    ],
)
def test_kept_checkpoints(
    tmp_path: Path, sync: str, save_every: int, keep_last: int, kept: list[str], written_by_save: list[str]
) -> None:
    cfg = compose_config(
        [
            f"rollout.weight_sync={sync}",
            "experiment.steps=7",
            f"checkpoint.save_every={save_every}",
            f"checkpoint.keep_last={keep_last}",
        ]
    )
    checkpoints, worker, disk = Checkpoints(cfg, tmp_path, rank0=True), Worker(), DiskSync(tmp_path / "checkpoints")
    for step in range(7):
        if sync == "disk":
            disk.export(step)
        checkpoints.after_step(worker, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept
    assert worker.saved == written_by_save


def test_bad_checkpoint_settings_are_refused() -> None:
    from tonpolicy.validation.validate import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(compose_config(["checkpoint.save_every=-1", "checkpoint.keep_last=0"]))
    assert "checkpoint.save_every=-1: must be >= 0" in str(e.value)
    assert "checkpoint.keep_last=0: must be a positive integer" in str(e.value)
