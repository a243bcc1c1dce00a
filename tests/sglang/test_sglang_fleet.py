"""A fleet of two released-SGLang servers (the contract's model package) behind sglang-router:
`python -m tonpolicy rollout=sglang rollout.replicas=2`. Weights go to both over one process group
(SGLang's own /init_weights_update_group at two rank offsets); every token carries the version SGLang
reports for it (meta_info.weight_versions). The router is killed (-9) once step 0 is recorded: the
launcher starts it again and the step's requests are re-sent through it; a request still running on a
replica under its rid is re-sent under the next attempt's rid (SGLang refuses a duplicate). About 3
minutes here: two SGLang start-ups on 2 cores.
The negative control of the fleet's numerics is tests/e2e/test_e2e_fleet.py's (the router does not
touch numerics), SGLang's own is test_sglang_real.py's off_policy run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from support.e2e_common import records, start_job, summary, wait_for
from support.sglang_proc import sglang_env_python

pytestmark = pytest.mark.slow


def test_two_sglang_replicas_are_exact_with_distributed_sync(tmp_path: Path) -> None:
    sglang_env_python()  # fails (or skips, as told) without the SGLang environment
    proc, run_dir = start_job(
        tmp_path,
        "rollout=sglang",
        "trainer.device=cpu",
        "rollout.replicas=2",
        "rollout.weight_sync=distributed",
        "experiment.steps=2",
    )
    wait_for(lambda: len(records(run_dir)) >= 1, 600, "step 0")
    os.kill(json.loads((run_dir / "pids.json").read_text())["rollout-router"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert "rollout router died (exit -9); starting it again" in err
    recs = records(run_dir)
    assert [r["mismatched_tokens"] for r in recs] == [0, 0] and all(r["tokens_scored"] > 0 for r in recs)
    assert [r["weight_versions"] for r in recs] == [
        {"default": recs[0]["tokens_scored"]},
        {"step_1": recs[1]["tokens_scored"]},
    ]
    assert summary(run_dir)["rollout"] == "sglang tp1 x2 replicas"
    assert sum(r["rollout_restarts"] for r in recs) == 1
    # the router spread the samples: both replicas answered /generate (round robin; re-sent ones too)
    served = [(run_dir / "logs" / f"rollout-{i}.log").read_text().count('"POST /generate') for i in (0, 1)]
    assert min(served) > 0 and sum(served) >= 16, served
