"""Asynchronous steps (experiment.max_staleness=1) as a user runs them: generation of the next batch
overlaps training, each sample is at most one version older than the weights it trains, and the gate
compares every token with the trainer's logprob under the version that sampled it: 0 mismatched tokens
on every step (with a fleet of two replicas and distributed weight sync, whose pushes land between the
producer's requests); the off-policy control shows the mismatch; a bad k is refused (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.e2e_common import records, run_job, with_fast


def _samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_one_step_stale_with_two_replicas_holds_exact_zero(tmp_path: Path) -> None:
    proc, run_dir = run_job(
        tmp_path,
        "experiment.max_staleness=1",
        "rollout.replicas=2",
        "rollout.weight_sync=distributed",
        "experiment.steps=3",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert [r["mismatched_tokens"] for r in recs] == [0, 0, 0] and all(r["tokens_scored"] > 0 for r in recs)
    assert [r["first_forward_mismatched"] for r in recs] == [0, 0, 0]
    assert [r["gate"] for r in recs] == ["passed"] * 3 and [r["max_staleness"] for r in recs] == [1] * 3
    assert [r["trainer_policy_version"] for r in recs] == [0, 1, 2]
    # step 0 trains the initial weights' samples; later steps' samples are at most one version old
    assert recs[0]["staleness"] == {"0": recs[0]["tokens_scored"]} and recs[0]["is_ratio_mean"] == 1.0
    assert recs[0]["first_forward_ratio_current_min"] == recs[0]["first_forward_ratio_current_max"] == 1.0
    for r in recs[1:]:
        assert set(r["staleness"]) <= {"0", "1"} and sum(r["staleness"].values()) == r["tokens_scored"]
        assert set(r["weight_versions"]) <= {
            f"step_{r['step'] - 1}" if r["step"] > 1 else "default",
            f"step_{r['step']}",
        }
        if "0" in r["staleness"]:  # tokens of the current version: the first forward is the rollout, bit for bit
            assert r["first_forward_ratio_current_min"] == r["first_forward_ratio_current_max"] == 1.0
    assert [r["ratio_min"] for r in recs] == [1.0] * 3 and [r["ratio_max"] for r in recs] == [1.0] * 3
    samples = _samples(run_dir)
    assert [len(v) for v in samples[1]["weight_versions"]] == [len(r) for r in samples[1]["responses"]]


def test_one_step_stale_off_policy_shows_the_mismatch(tmp_path: Path) -> None:
    """Negative control: plain kernels on both sides; the same check under the sampling version finds
    tokens that differ (recorded, not failed: off_policy promises no exact zero)."""
    proc, run_dir = run_job(tmp_path, "experiment.max_staleness=1", "contract=off_policy", "experiment.steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert all(r["mismatched_tokens"] > 0 for r in recs) and recs[1]["staleness"] == {"1": recs[1]["tokens_scored"]}


def test_a_negative_staleness_is_refused_before_anything_starts(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "tonpolicy", "mode=plan", *with_fast("experiment.max_staleness=-1")]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "experiment.max_staleness=-1: must be >= 0" in proc.stderr, proc.stderr[-2000:]
