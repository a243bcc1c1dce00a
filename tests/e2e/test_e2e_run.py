"""End to end: rollout server + Megatron trainer ranks, exact-zero gate, weight sync, negative control."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from support.e2e_common import FAST, records, run_job, run_sweep, summary, with_fast


@pytest.fixture(scope="module")
def tp1_wandb_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One TP 1 job of three steps on the default logger (W&B, offline), read by the two tests below:
    the logger only writes what the run computes, so one job serves both."""
    proc, run_dir = run_job(tmp_path_factory.mktemp("tp1"), "parallel=tp1", "experiment.steps=3", "logger=wandb")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, run_dir


def test_tp1_multi_step_with_weight_sync(tp1_wandb_job: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, run_dir = tp1_wandb_job
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert r["tokens_scored"] > 0 and r["mismatched_tokens"] == 0 and r["max_abs_logprob_diff"] == 0.0
        assert r["train_rollout_logprob_abs_diff"] == 0.0
    assert all(r["grad_norm"] > 0 for r in recs[:2])
    # Weights changed between steps (the sync had work to do) and parity held after each sync.
    from safetensors.torch import load_file

    init = load_file(run_dir / "checkpoints" / "init" / "model.safetensors")
    final = load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")
    assert any(not torch.equal(init[k], final[k]) for k in init)
    # The per-step checkpoints the server loaded are gone once superseded; the final one stays.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["init", "step_3"]
    s = summary(run_dir)
    assert s["status"] == "ok" and s["steps_completed"] == 3 and s["mismatched_tokens"] == 0
    assert "grad_norm" in proc.stdout and "mismatched" in proc.stdout  # the per-step table
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3


def test_distributed_weight_sync_writes_nothing_and_stays_exact(tmp_path: Path) -> None:
    """rollout.weight_sync=distributed at TP 2: weights go over a gloo group, no checkpoint per step
    (the final weights are saved all the same), and the gate (rollout == recompute with the new
    weights) holds on every step. Run through the public API, as another program would (in process):
    `api.run` gives the exit code, the run directory and the summary."""
    from tonpolicy import api

    run_dir = tmp_path / "run"
    result = api.run(with_fast("parallel=tp2", "experiment.steps=3", "rollout.weight_sync=distributed"), run_dir)
    assert result.exit_code == 0 and result.ok and result.problems == [], (result.problems, result.summary)
    assert result.run_dir == run_dir and result.summary == summary(run_dir)
    assert result.summary["status"] == "ok" and result.summary["steps_completed"] == 3
    assert result.summary["mismatched_tokens"] == 0 and result.summary["layout"] == "tp2"
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(r["mismatched_tokens"] == 0 and r["max_abs_logprob_diff"] == 0.0 for r in recs)
    assert all(r["grad_norm"] > 0 for r in recs)  # the weights moved, so a stale server would mismatch
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["init", "step_3"]
    from safetensors.torch import load_file

    init, final = (load_file(run_dir / "checkpoints" / d / "model.safetensors") for d in ("init", "step_3"))
    assert init.keys() == final.keys() and any(not torch.equal(init[k], final[k]) for k in init)


def test_bf16_logits_contract_stays_exact(tmp_path: Path) -> None:
    """contract.logits_dtype=bfloat16 (the LM head on the native bf16 GEMM, logits rounded to bf16 as
    stock SGLang does): another fingerprint, and still exact zero at TP 2 on every step (the trainer's
    vocab-parallel head gives the same bits)."""
    proc, run_dir = run_job(tmp_path, "parallel=tp2", "experiment.steps=2", "contract.logits_dtype=bfloat16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert all(r["tokens_scored"] > 0 and r["mismatched_tokens"] == 0 for r in recs) and len(recs) == 2
    plan = json.loads((run_dir / "launch_plan.json").read_text())
    assert plan["megatron"]["kernels"]["logits_dtype"] == "bfloat16"


def test_sweep_over_layouts_exact_zero(tmp_path: Path) -> None:
    """`-m parallel=...`: each layout's job proves exact zero; the sweep writes a table and a chart."""
    layouts = ["tp2", "pp2", "cp2_ulysses", "cp2_ring"]
    sweep, jobs = run_sweep(tmp_path, layouts, [*FAST, "experiment.steps=1"])
    for job in jobs:
        (rec,) = records(job)
        assert rec["tokens_scored"] > 0 and rec["mismatched_tokens"] == 0, (job.name, rec)
    table = (sweep / "sweep_summary.md").read_text()
    assert all(layout in table for layout in layouts)
    assert (sweep / "sweep_summary.png").stat().st_size > 1000


def test_off_policy_shows_the_mismatch(tmp_path: Path) -> None:
    """Negative control: plain kernels on both sides; the gate reports (not fails) the mismatch."""
    proc, run_dir = run_job(tmp_path, "contract=off_policy", "parallel=tp1", "experiment.steps=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rec,) = records(run_dir)
    assert rec["mismatched_tokens"] > 0 and rec["max_abs_logprob_diff"] > 0


def test_gate_fails_the_run_when_forced_on_off_policy(tmp_path: Path) -> None:
    proc, run_dir = run_job(tmp_path, "contract=off_policy", "gate.fail_on_mismatch=true", "experiment.steps=2")
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "parity gate failed at step 0" in proc.stderr
    assert len(records(run_dir)) == 1 and summary(run_dir)["status"] == "gate_failed"
    # The gate runs before the update: the failing step trained nothing and synced nothing.
    assert records(run_dir)[0]["gate"] == "failed" and "grad_norm" not in records(run_dir)[0]
    assert not (run_dir / "checkpoints" / "step_1").exists()


def test_wandb_offline_run_holds_parity_and_grad_norm_per_step(
    tp1_wandb_job: tuple[subprocess.CompletedProcess, Path],
) -> None:
    """The default logger (W&B, offline): one history row per step with the parity and grad_norm keys,
    equal to the step records."""
    from support.wandb_records import history

    from tonpolicy.launch.wandb_keys import wandb_key

    _, run_dir = tp1_wandb_job
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = history(run_file)
    recs = records(run_dir)
    assert len(rows) == len(recs) == 3
    for row, rec in zip(rows, recs, strict=True):
        for key in ("mismatched_tokens", "max_abs_logprob_diff", "train_rollout_logprob_abs_diff", "grad_norm"):
            assert row[wandb_key(key)] == rec[key], key  # namespaced in W&B (parity/, train/), flat in the records
        assert row["parity/mismatched_tokens"] == 0 and row["step"] == rec["step"]
        assert "parity/exact" not in row and "time" not in row  # not charted
        assert row["perf/peak_rss_mib"] > 0 and row["perf/rollout_tokens_per_s"] > 0
        # The embedded server's peak, beside the trainer's (its process tree's, from /proc).
        assert row["perf/peak_rollout_rss_mib"] == rec["peak_rollout_rss_mib"] > 0
