"""Run dirs, plans, W&B names and sweep rows are labelled from the resolved layout, not the option."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config, group_options
from tonpolicy.config.names import layout_label
from tonpolicy.launch.plan import launch_plan


@pytest.mark.parametrize("option", group_options("parallel"))
def test_shipped_options_are_named_by_their_label(option: str) -> None:
    assert layout_label(compose_config([f"parallel={option}"]).parallel) == option


def test_an_override_renames_the_layout(tmp_path: Path) -> None:
    cfg = compose_config(["parallel=tp1", "parallel.tp=2"])
    assert launch_plan(cfg, tmp_path)["layout"] == "tp2"
    cfg = compose_config(["parallel=pp2", "parallel.pp_layers=[3,1]", "parallel.dp=2"])
    assert layout_label(cfg.parallel) == "pp2_3-1_dp2"


def test_run_dir_follows_the_resolved_layout(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "tonpolicy", "mode=plan", "parallel=tp1", "parallel.tp=2", "logger=none"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert run_dir.name.endswith("_qwen3_dense_v2_tp2"), run_dir
