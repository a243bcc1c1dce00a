"""The multi-turn tool task through `python -m tonpolicy task=calculator`: every model token of every turn
is gated with exact zero at each layout (tp1, tp2, pp2, cp2_ring), the environment's tokens are in the
context but neither gated nor trained on, and later turns reuse the earlier turns' K/V from the
server's prefix cache. The off-policy control shows the mismatch on the same task."""

from __future__ import annotations

import json
from pathlib import Path

from support.e2e_common import records, run_job, run_sweep, with_fast

MULTI_TURN = ["task=calculator", "task.graded_tokens=1", "task.max_turns=3", "experiment.max_new_tokens=4"]


def check_samples(run_dir: Path, turns: int) -> None:
    """samples.jsonl says who said what: model and environment turns alternate, env turns untrained."""
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        for sample, response in zip(json.loads(line)["turns"], json.loads(line)["responses"], strict=True):
            whos = [t["who"] for t in sample]
            assert whos == ["model", "env"] * (turns - 1) + ["model"], whos
            assert all(t["trained"] == (t["who"] == "model") for t in sample)
            assert [i for t in sample for i in t["ids"]] == response


def test_calculator_exact_zero_at_every_layout_with_prefix_reuse(tmp_path: Path) -> None:
    layouts = ["tp1", "tp2", "pp2", "cp2_ring"]
    _, jobs = run_sweep(tmp_path, layouts, with_fast(*MULTI_TURN, "experiment.steps=1"))
    for job in jobs:
        (rec,) = records(job)
        # 8 samples x 3 model turns of 1..4 tokens each: the gate scored the model's tokens, only
        assert rec["tokens_scored"] == rec["model_tokens"] >= 24 and rec["mismatched_tokens"] == 0, (job.name, rec)
        assert rec["gate"] == "passed" and rec["cached_tokens"] > 0, (job.name, rec)
        check_samples(job, turns=3)


def test_calculator_off_policy_shows_the_mismatch(tmp_path: Path) -> None:
    """Negative control: plain kernels on both sides; the model tokens' mismatch is reported."""
    proc, run_dir = run_job(tmp_path, "contract=off_policy", *MULTI_TURN, "experiment.steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for step, rec in enumerate(records(run_dir)):
        assert rec["tokens_scored"] == rec["model_tokens"] and rec["mismatched_tokens"] > 0, rec
        # the version that sampled each model token: the initial weights, then step 0's update
        assert rec["weight_versions"] == {"step_1" if step else "default": rec["model_tokens"]}, rec
    for step, line in enumerate((run_dir / "samples.jsonl").read_text().splitlines()):
        sample = json.loads(line)
        for versions, turns in zip(sample["weight_versions"], sample["turns"], strict=True):
            want = [("step_1" if step else "default") if t["who"] == "model" else None for t in turns for _ in t["ids"]]
            assert versions == want
