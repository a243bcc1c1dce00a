"""The RL loop learns: the default run (task first_parity: answer with the parity of the digit before
':', which the model must attend back to) with fixed seeds is deterministic, so the reward of the last
steps must exceed the first steps' by a margin, with 0 mismatched tokens on every step, the samples
readable as text and reward_curve.png written. Negative control: the same run with the advantages'
sign flipped (a broken update) must not learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = ["logger=none"]  # the default experiment as it is


def _start(run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tonpolicy", *STEPS, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        argv,
        cwd=run_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[list[float], Path]]:
    """Both runs at once (each is a server and a trainer rank taking turns: together they fill two cores);
    their bits do not depend on what else the machine runs."""
    dirs = {broken: tmp_path_factory.mktemp("broken" if broken else "update") / "run" for broken in (False, True)}
    procs = {
        broken: _start(run_dir, {"TONPOLICY_FAULT": "flip_advantages"} if broken else None)
        for broken, run_dir in dirs.items()
    }
    out = {}
    try:
        for broken, proc in procs.items():
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
            summary = json.loads((dirs[broken] / "summary.json").read_text())
            assert summary["mismatched_tokens"] == 0 and summary["task"] == "first_parity"
            out[broken] = (summary["rewards"], dirs[broken])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.parametrize("broken", [False, True], ids=["update", "flipped_advantages"])
def test_reward_rises_only_with_a_working_update(runs: dict[bool, tuple[list[float], Path]], broken: bool) -> None:
    rewards, run_dir = runs[broken]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print("rewards", [round(r, 3) for r in rewards])
    if broken:
        assert last <= first + 0.05, rewards
    else:
        assert last >= first + 0.3, rewards
        assert (run_dir / "reward_curve.png").stat().st_size > 1000
        sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[-1])
        prompt, answer = sample["prompt_texts"][0].split(), sample["response_texts"][0].split()
        assert prompt[0] == "first" and prompt[1].isdigit() and prompt[2] == ":" and len(answer) == 1
        # Learnt from the prompt, not one answer for all: right for even and for odd digits alike.
        by_parity: dict[int, list[float]] = {0: [], 1: []}
        for text, r in zip(sample["prompt_texts"], sample["rewards"], strict=True):
            by_parity[int(text.split()[1]) % 2].append(r)
        assert all(len(rs) >= 4 and sum(rs) / len(rs) >= 0.75 for rs in by_parity.values()), by_parity
