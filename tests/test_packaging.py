"""A non-editable install carries the Hydra config groups and runs from anywhere."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tonpolicy.config.compose import CONF_DIR

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_every_config_and_composes(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("tonpolicy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    yamls = {f"tonpolicy/conf/{p.relative_to(CONF_DIR)}" for p in CONF_DIR.rglob("*.yaml")}
    assert yamls and yamls <= names, yamls - names
    assert "tonpolicy/kernels/invariant/exact_gemv.cpp" in names  # the compiled few-row products build from it
    assets = {f"tonpolicy/{p.relative_to(CONF_DIR.parent)}" for p in (CONF_DIR.parent / "assets").rglob("*.*")}
    assert assets and assets <= names, assets - names  # what ${asset:...} resolves to

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = "import tonpolicy, sys; print(tonpolicy.__file__)"
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr

    def tonpolicy(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "tonpolicy", *args]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc

    proc = tonpolicy("--cfg", "job", "model=qwen3_4b", "parallel=tp2_pp2")
    assert "name: qwen3_4b" in proc.stdout and "name: tp2_pp2" in proc.stdout
    # an experiment whose files ship in the package resolves them there
    proc = tonpolicy("--cfg", "job", "--resolve", "experiment=bpe_chat")
    assert f"{target}/tonpolicy/assets/bpe_chat/train.jsonl" in proc.stdout, proc.stdout
