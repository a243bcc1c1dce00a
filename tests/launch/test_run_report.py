"""The launcher's status line and end-of-run lines name the run directory, the plot and the W&B sync
command (only what exists)."""

from __future__ import annotations

from pathlib import Path

from tonpolicy.config.compose import compose_config
from tonpolicy.launch.run_report import startup_line, where_lines


def test_startup_line_names_servers_ranks_and_run_dir(tmp_path: Path) -> None:
    line = startup_line(compose_config(["parallel=tp2"]), tmp_path, 1, 2)
    assert "1 rollout server(s) (embedded)" in line and "2 trainer rank(s) (tp2)" in line and str(tmp_path) in line


def test_where_lines_name_what_exists(tmp_path: Path) -> None:
    assert len(where_lines(tmp_path)) == 1 and str(tmp_path) in where_lines(tmp_path)[0]
    (tmp_path / "reward_curve.png").write_bytes(b"")
    run = tmp_path / "wandb" / "offline-run-20260101_000000-abc"
    run.mkdir(parents=True)
    lines = where_lines(tmp_path)
    assert lines[1] == f"tonpolicy: plot {tmp_path / 'reward_curve.png'}"
    assert lines[2].endswith(f"wandb sync {run}")
