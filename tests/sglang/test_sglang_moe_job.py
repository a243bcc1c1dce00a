"""`python -m tonpolicy model=qwen3_moe_tiny rollout=sglang ...`: released SGLang serves the MoE model on
the contract package, Megatron-core trains it with expert parallelism, and the gate compares the two
directly, every step, after weight sync (issue 34, item 9: trainer ep2 and tp2_ep2, SGLang --tp-size 1
and 2, the latter with --ep-size 2). Routing agreement is measured from the routes SGLang returns
(`--enable-return-routed-experts`, which the launch plan renders for a MoE model on the contract package).

Negative control: tests/sglang/test_sglang_moe.py runs the same package on the plain kernel set (torch's
own GEMMs, `torch.topk`, activation-dtype combine) and finds a small non-zero mismatch against the same
scoring; a job cannot run it (validation ties the plain set to stock SGLang, whose own Qwen3-MoE returns
null logprobs on this CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.e2e_common import records, run_job, summary
from support.sglang_proc import sglang_env_python

MOE = ("model=qwen3_moe_tiny", "rollout=sglang", "trainer.device=cpu", "contract.dtype=float32")


@pytest.fixture(scope="module")
def sglang_py() -> str:
    return sglang_env_python()


def _run(tmp_path: Path, steps: int, *overrides: str) -> tuple[list[dict], dict]:
    proc, run_dir = run_job(tmp_path, *MOE, f"experiment.steps={steps}", *overrides, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return records(run_dir), summary(run_dir)


@pytest.mark.parametrize(
    "layout",
    [
        ("parallel=ep2",),  # SGLang --tp-size 1; trainer dp2 with ep2
        ("parallel=tp2_ep2", "parallel.rollout_tp=2", "parallel.rollout_ep=2"),  # SGLang --tp-size 2 --ep-size 2
    ],
    ids=["sglang_tp1-trainer_ep2", "sglang_tp2_ep2-trainer_tp2_ep2"],
)
def test_sglang_moe_job_is_exact_and_routes_agree(tmp_path: Path, sglang_py: str, layout: tuple[str, ...]) -> None:
    recs, s = _run(tmp_path, 2, *layout)
    assert [r["step"] for r in recs] == [0, 1] and s["status"] == "ok", recs
    for r in recs:  # step 1 runs on the weights synced after step 0's update
        assert r["tokens_scored"] > 0 and r["mismatched_tokens"] == 0 and r["max_abs_logprob_diff"] == 0.0, r
        assert r["routing_agreement"] == 1.0, r
        assert r["grad_norm"] > 0, r
