"""A fleet of two released-SGLang servers (the contract's model package) behind sglang-router:
`python -m tonpolicy rollout=sglang rollout.replicas=2`. Weights go to both over one process group
(SGLang's own /init_weights_update_group at two rank offsets); every token carries the version SGLang
reports for it (meta_info.weight_versions). About 3 minutes here: two SGLang start-ups on 2 cores.
The negative control of the fleet's numerics is tests/e2e/test_e2e_fleet.py's (the router does not
touch numerics), SGLang's own is test_sglang_real.py's off_policy run."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.e2e_common import records, run_job, summary
from support.sglang_proc import sglang_env_python

pytestmark = pytest.mark.slow


def test_two_sglang_replicas_are_exact_with_distributed_sync(tmp_path: Path) -> None:
    sglang_env_python()  # fails (or skips, as told) without the SGLang environment
    proc, run_dir = run_job(
        tmp_path,
        "rollout=sglang",
        "trainer.device=cpu",
        "rollout.replicas=2",
        "rollout.weight_sync=distributed",
        "experiment.steps=2",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert [r["mismatched_tokens"] for r in recs] == [0, 0] and all(r["tokens_scored"] > 0 for r in recs)
    assert [r["weight_versions"] for r in recs] == [
        {"default": recs[0]["tokens_scored"]},
        {"step_1": recs[1]["tokens_scored"]},
    ]
    assert summary(run_dir)["rollout"] == "sglang tp1 x2 replicas"
    # the router spread the samples: both replicas answered /generate (round robin, 8 of the 16 each)
    served = [(run_dir / "logs" / f"rollout-{i}.log").read_text().count('"POST /generate') for i in (0, 1)]
    assert served == [8, 8], served
