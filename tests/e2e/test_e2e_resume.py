"""Resume bit for bit, at tp1 and at a TP x PP layout: a run of 3 steps whose trainer dies after its
step-2 checkpoint, resumed with checkpoint.resume=auto, writes the same step records (apart from times)
and ends with the same weights, bit for bit, as a run that was never interrupted. Control (tp1):
resumed with the weights but a fresh optimizer (TONPOLICY_FAULT=resume_without_optimizer_state), the
same gradient makes other weights."""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file
from support.e2e_common import records, tonpolicy_argv

JOB = ("experiment.steps=3", "checkpoint.save_every=2")
LAYOUTS = {"tp1": True, "tp2_pp2": False}  # layout -> whether its runs include the control


def _strip(record: dict) -> dict:
    # times, rates and the process's peak memory differ between runs
    return {k: v for k, v in record.items() if k != "time" and not k.endswith(("_s", "_mib"))}


def _run(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **({"TONPOLICY_FAULT": fault} if fault else {})}
    argv = tonpolicy_argv(run_dir, *JOB, *extra)
    return subprocess.run(argv, cwd=run_dir.parent, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted run beside a run killed at step 2 (its trainer's rank 0 dies); that run resumed
    as shipped and (tp1), from a copy of it, resumed forgetting the optimizer's state."""
    layout, control = f"parallel={request.param}", LAYOUTS[request.param]
    names = ("whole", "resumed", "control") if control else ("whole", "resumed")
    dirs = {name: tmp_path_factory.mktemp(f"{name}_{request.param}") / "run" for name in names}
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(_run, dirs["whole"], layout)
        killed = _run(dirs["resumed"], layout, fault="rank_exit:0:2")
        assert whole.result().returncode == 0, whole.result().stderr[-3000:]
    assert killed.returncode == 4, killed.stderr[-3000:]
    assert [r["step"] for r in records(dirs["resumed"])] == [0, 1]
    if control:
        shutil.copytree(dirs["resumed"], dirs["control"])
    with ThreadPoolExecutor(2) as pool:
        again = [pool.submit(_run, dirs["resumed"], layout, "checkpoint.resume=auto")]
        if control:
            fault = "resume_without_optimizer_state"
            again.append(pool.submit(_run, dirs["control"], layout, "checkpoint.resume=auto", fault=fault))
        for future in again:
            proc = future.result()
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "resuming after step 1" in proc.stderr
    return dirs


def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(runs: dict[str, Path]) -> None:
    whole, resumed = records(runs["whole"]), records(runs["resumed"])
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert [_strip(r) for r in resumed] == [_strip(r) for r in whole]
    final = [_final(runs[n]) for n in ("whole", "resumed")]
    assert final[0].keys() == final[1].keys() and all(final[0][k].equal(final[1][k]) for k in final[0])
    samples = [(runs[n] / "samples.jsonl").read_text().splitlines() for n in ("whole", "resumed")]
    assert [json.loads(s)["responses"] for s in samples[0]] == [json.loads(s)["responses"] for s in samples[1]]


@pytest.mark.parametrize("runs", ["tp1"], indirect=True)  # what it shows does not depend on the layout
def test_without_the_optimizer_state_the_resumed_run_differs(runs: dict[str, Path]) -> None:
    whole, control = records(runs["whole"]), records(runs["control"])
    assert [_strip(r) for r in control[:2]] == [_strip(r) for r in whole[:2]]
    assert control[2]["grad_norm"] == whole[2]["grad_norm"]  # same weights, same batch: same gradient
    final = [_final(runs[n]) for n in ("whole", "control")]
    assert any(not final[0][k].equal(final[1][k]) for k in final[0])  # but another update


def _final(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")
