"""The code a run ran: the package version and the git commit of its checkout, in `--version`,
summary.json and the W&B config; never a failure where there is no git or no checkout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import tonpolicy.version as version
from tonpolicy.config.compose import compose_config
from tonpolicy.version import build_info, git_commit, package_version, version_line

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def git(repo: Path, *args: str) -> str:
    quiet = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=m"]
    return subprocess.run(["git", *quiet, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def repository(root: Path, package_at: str) -> Path:
    """A repository at `root` with one commit, and a `tonpolicy` folder at `package_at` inside it."""
    package = root / package_at / "tonpolicy"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (root / "README").write_text("r\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "one")
    return package.resolve()


def test_this_checkout() -> None:
    info = build_info()
    assert info["version"] == PYPROJECT_VERSION
    assert re.fullmatch(r"[0-9a-f]{40}", info["commit"]), info
    git(ROOT, "cat-file", "-e", f"{info['commit']}^{{commit}}")  # a commit of this repository
    assert isinstance(info["dirty"], bool)


def test_commit_and_dirty_of_the_checkout_holding_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = repository(tmp_path, ".")
    monkeypatch.setattr(version, "PACKAGE_DIR", package)
    assert git_commit() == (git(tmp_path, "rev-parse", "HEAD").strip(), False)
    (tmp_path / "scratch.txt").write_text("an untracked file is no change\n")
    assert git_commit()[1] is False
    (package / "__init__.py").write_text("x = 1\n")
    assert git_commit()[1] is True


def test_no_commit_where_the_package_is_not_the_checkouts_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A wheel installed into a virtual environment inside some repository: not that repository's code.
    monkeypatch.setattr(version, "PACKAGE_DIR", repository(tmp_path / "repo", ".venv/site-packages"))
    assert git_commit() == (None, None)
    plain = tmp_path / "plain" / "tonpolicy"
    plain.mkdir(parents=True)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setattr(version, "PACKAGE_DIR", plain)
    assert git_commit() == (None, None)


def test_no_git_or_a_slow_one_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    assert git_commit()[0] is not None  # the control: this checkout has one
    monkeypatch.setattr(version, "GIT_TIMEOUT_S", 1e-6)
    assert git_commit() == (None, None)
    monkeypatch.undo()
    monkeypatch.setenv("PATH", "")
    assert git_commit() == (None, None)


def test_version_from_pyproject_when_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise version.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.metadata, "version", not_installed)
    assert package_version() == PYPROJECT_VERSION
    (tmp_path / "tonpolicy").mkdir()
    monkeypatch.setattr(version, "PACKAGE_DIR", tmp_path / "tonpolicy")  # no pyproject.toml beside it
    assert package_version() is None


def test_version_line() -> None:
    sha = "0123456789abcdef" * 2 + "01234567"
    assert version_line({"version": "1.2.3", "commit": sha, "dirty": False}) == "tonpolicy 1.2.3 (commit 0123456789ab)"
    assert version_line({"version": "1.2.3", "commit": sha, "dirty": True}).endswith("(commit 0123456789ab, dirty)")
    assert version_line({"version": None, "commit": None, "dirty": None}) == "tonpolicy unknown"


@pytest.mark.parametrize("args", [["--version"], ["mode=plan", "--version"]])
def test_version_flag_is_tonpolicys(tmp_path: Path, args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # Hydra's own flag would print "Hydra 1.3.x".
    assert re.fullmatch(rf"tonpolicy {re.escape(PYPROJECT_VERSION)} \(commit [0-9a-f]{{12}}(, dirty)?\)\n", proc.stdout)
    assert list(tmp_path.iterdir()) == []  # Hydra never started: no outputs/ folder


def test_summary_and_wandb_config_record_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tonpolicy.launch.job import summarize
    from tonpolicy.launch.wandb_log import WandbLogger

    cfg = compose_config()
    assert summarize(cfg, tmp_path, "ok", 1.0)["tonpolicy"] == build_info()
    assert json.loads((tmp_path / "summary.json").read_text())["tonpolicy"] == build_info()

    seen: dict = {}
    fake_wandb = types.SimpleNamespace(init=lambda **kw: seen.update(kw))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    cfg.logger.backend, cfg.logger.mode = "wandb", "offline"
    WandbLogger(cfg, tmp_path)
    assert seen["config"]["tonpolicy"] == build_info()
