"""`python -m tonpolicy model=qwen3_moe_tiny rollout=sglang ...`: released SGLang serves the MoE model on
the contract package, Megatron-core trains it with expert parallelism, and the gate compares the two
directly, every step, after weight sync (issue 34, item 9: trainer ep2 and tp2_ep2, SGLang --tp-size 1
and 2, the latter with --ep-size 2). Routing agreement is measured from the routes SGLang returns
(`--enable-return-routed-experts`, which the launch plan renders for a MoE model on the contract package).

The tp2_ep2 case runs FP8 rollouts (contract.quant=fp8_block): the experts' 96 gate/up rows end in a partial
128-row weight block, quantized by the package as by the trainer. Its control: step 0's rollout logprobs,
scored here on the initial weights, are the fp8 set's bits and not the unquantized set's.

Negative control: tests/sglang/test_sglang_moe.py runs the same package on the plain kernel set (torch's
own GEMMs, `torch.topk`, activation-dtype combine) and finds a small non-zero mismatch against the same
scoring; a job cannot run it (validation ties the plain set to stock SGLang, whose own Qwen3-MoE returns
null logprobs on this CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.e2e_common import records, run_job, samples, summary
from support.sglang_proc import sglang_env_python

from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf

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
        # SGLang --tp-size 2 --ep-size 2, FP8
        ("parallel=tp2_ep2", "parallel.rollout_tp=2", "parallel.rollout_ep=2", "contract.quant=fp8_block"),
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
    if "contract.quant=fp8_block" in layout:
        run_dir = tmp_path / "run"
        fp8, plain = (_mismatched(run_dir, quant) for quant in ("fp8_block", "none"))
        assert fp8[0] == plain[0] > 0 and fp8[1] == 0 and plain[1] > 0, (fp8, plain)


def _mismatched(run_dir: Path, quant: str, sequences: int = 8) -> tuple[int, int]:
    """(tokens, mismatched): step 0's rollout logprobs against the ordered set with `quant` on the initial
    weights (fp32, T = 1: the job's), fp32 bit patterns."""
    cfg, sd = load_hf(run_dir / "checkpoints" / "init", torch.float32)
    model = resolve(family(cfg.family).engine_model)(cfg, get_kernels("ordered", quant=quant), torch.float32, sd)
    step = samples(run_dir)[0]
    total = bad = 0
    rows = zip(step["prompts"], step["responses"], step["rollout_logprobs"], strict=True)
    for prompt, resp, lps in list(rows)[:sequences]:
        logprobs = model.kernels.log_softmax(model(torch.tensor(prompt + resp)), cfg.vocab_size, 1.0)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(resp))
        total += len(resp)
        served = torch.tensor(lps, dtype=torch.float32).view(torch.int32)
        bad += int((logprobs[at, torch.tensor(resp)].float().view(torch.int32) != served).sum())
    return total, bad
