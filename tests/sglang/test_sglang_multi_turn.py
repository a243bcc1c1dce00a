"""`python -m tonpolicy rollout=sglang task=calculator`: released SGLang (its radix cache on, as by
default) serves the multi-turn tool task on the contract package; every model token of every turn is
gated with exact zero, and later turns come from SGLang's prefix cache (meta_info.cached_tokens). The
embedded engine's cache on/off and decode- vs prefill-written K/V are proven with their controls in
tests/engine/test_prefix_cache.py; the multi-turn control in tests/e2e/test_e2e_multi_turn.py."""

from __future__ import annotations

from pathlib import Path

from support.e2e_common import records, run_job, summary

MULTI_TURN = (
    "rollout=sglang",
    "trainer.device=cpu",
    "task=calculator",
    "task.graded_tokens=1",
    "task.max_turns=3",
    "experiment.max_new_tokens=4",
    "experiment.steps=1",
)


def test_sglang_multi_turn_exact_zero_with_radix_cache(tmp_path: Path) -> None:
    proc, run_dir = run_job(tmp_path, *MULTI_TURN, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rec,) = records(run_dir)
    assert rec["tokens_scored"] == rec["model_tokens"] >= 24 and rec["mismatched_tokens"] == 0, rec
    assert rec["cached_tokens"] > 0, rec  # SGLang's radix cache served the earlier turns
    assert summary(run_dir)["status"] == "ok"
