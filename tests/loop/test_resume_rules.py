"""checkpoint.resume: which saved step it takes, and what it refuses before anything starts (another
layout, a directory without trainer state, asynchronous steps, a run already done)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.loop.resume import drop_records_from, resume_dir


def _saved(run_dir: Path, completed: int, layout: str = "tp1") -> Path:
    path = run_dir / "checkpoints" / f"step_{completed}"
    path.mkdir(parents=True)
    meta = {"completed_steps": completed, "layout": layout, "adam_step": float(completed)}
    (path / "trainer_state.json").write_text(json.dumps(meta))
    return path


def test_auto_takes_the_newest_saved_step_or_starts_afresh(tmp_path: Path) -> None:
    cfg = compose_config(["checkpoint.resume=auto", "experiment.steps=10"])
    assert resume_dir(cfg, tmp_path) == (None, None)
    _saved(tmp_path, 2)
    _saved(tmp_path, 4)
    (tmp_path / "checkpoints" / "step_9").mkdir()  # weights only (a disk-sync step): not resumable
    assert resume_dir(cfg, tmp_path) == (tmp_path / "checkpoints" / "step_4", None)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["parallel=tp2"], "was saved at layout tp1, this run is tp2"),
        (["experiment.max_staleness=1"], "asynchronous steps"),
        (["experiment.steps=2"], "has 2 steps done, experiment.steps=2"),
    ],
)
def test_refusals(tmp_path: Path, overrides: list[str], says: str) -> None:
    path = _saved(tmp_path, 2)
    cfg = compose_config([f"checkpoint.resume={path}", *overrides])
    assert says in resume_dir(cfg, tmp_path)[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no trainer_state.json" in resume_dir(compose_config([f"checkpoint.resume={empty}"]), tmp_path)[1]


def test_the_records_after_the_saved_step_are_dropped(tmp_path: Path) -> None:
    lines = "".join(json.dumps({"step": k}) + "\n" for k in range(4))
    (tmp_path / "metrics.jsonl").write_text(lines)
    drop_records_from(tmp_path, 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
