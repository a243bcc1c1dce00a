"""SGLang is pinned to the release tonpolicy is tested with, in every place that installs it, and another
release is refused naming the found and the required one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tonpolicy import api
from tonpolicy.config.sglang_release import sglang_release_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_pins_are_the_tested_release() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert extra == [f"sglang=={api.SGLANG_VERSION}"]
    setup = (ROOT / "scripts" / "setup_sglang.sh").read_text()
    pins = re.findall(r"sglang==([\w.]+)", setup)
    assert pins and set(pins) == {api.SGLANG_VERSION}, pins


def test_another_release_is_refused_naming_both() -> None:
    assert sglang_release_problem(api.SGLANG_VERSION) is None
    problem = sglang_release_problem("0.5.22")
    assert problem is not None and "sglang 0.5.22 is installed" in problem
    assert f"sglang=={api.SGLANG_VERSION}" in problem and "scripts/setup_sglang.sh" in problem
    missing = sglang_release_problem(None)
    assert missing is not None and "sglang is not installed" in missing


def test_tonpolicys_sglang_plugin_is_declared() -> None:
    """SGLang finds the contract sampler's registration through this entry point (an installed tonpolicy)."""
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points["sglang.srt.plugins"] == {
        "tonpolicy_contract_sampler": "tonpolicy.inside_sglang.plugin:register"
    }
