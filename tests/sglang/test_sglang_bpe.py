"""The real-vocabulary example through released SGLang (`python -m tonpolicy experiment=bpe_chat
rollout=sglang`): chat prompts, a byte-level BPE carried by the random-init checkpoint, which SGLang
loads itself (through transformers). Needs the SGLang environment (scripts/setup_sglang.sh). Its
negative control is tests/sglang/test_sglang_real.py::test_off_policy_through_real_sglang_shows_the_mismatch
(the same job machinery, the mismatch shown).

The job runs FP8 rollouts (contract.quant=fp8_block): the contract package inside SGLang quantizes the
master weights it loads and is synced by the one rule, so the fp8 trainer's gate finds 0 mismatched tokens.
Control: step 0's rollout logprobs, scored here on the initial weights, are the fp8 set's bits and not
the unquantized v2 set's (a package that ignored contract.quant would have sampled the latter)."""

from __future__ import annotations

from pathlib import Path

import torch
from support.e2e_common import records, run_job, samples, summary

from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf


def test_bpe_chat_through_real_sglang_is_exact(tmp_path: Path, sglang_py: str) -> None:
    """Exact zero on every step and every token; the rewards read the decoded answers without error."""
    short = ("experiment.steps=2", "experiment.prompts_per_step=2", "experiment.max_new_tokens=3")
    small = (*short, "experiment.max_prompt_len=24", "experiment.top_k=16", "task.graded_tokens=1")
    proc, run_dir = run_job(
        tmp_path,
        "experiment=bpe_chat",
        "rollout=sglang",
        "trainer.device=cpu",
        *small,
        "rollout.skip_tokenizer_init=false",
        "contract.quant=fp8_block",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records(run_dir)
    assert summary(run_dir)["status"] == "ok" and [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert r["mismatched_tokens"] == 0 and r["max_abs_logprob_diff"] == 0.0 and r["tokens_scored"] > 0, r
        assert r["reward_errors"] == 0, r
    texts = [t for step in samples(run_dir) for t in step["prompt_texts"]]
    assert texts and all(t.startswith("<|im_start|>user\nIs ") for t in texts), texts[:2]
    fp8, v2 = (_mismatched(run_dir, quant) for quant in ("fp8_block", "none"))
    assert fp8[0] == v2[0] > 0 and fp8[1] == 0 and v2[1] > 0, (fp8, v2)


def _mismatched(run_dir: Path, quant: str, sequences: int = 8) -> tuple[int, int]:
    """(tokens, mismatched): step 0's rollout logprobs against the ordered set with `quant` on the initial
    weights (bf16, T = 1: the job's), fp32 bit patterns."""
    cfg, sd = load_hf(run_dir / "checkpoints" / "init", torch.bfloat16)
    model = resolve(family(cfg.family).engine_model)(cfg, get_kernels("ordered", quant=quant), torch.bfloat16, sd)
    step = samples(run_dir)[0]
    total = bad = 0
    for prompt, resp, lps in list(zip(step["prompts"], step["responses"], step["rollout_logprobs"], strict=True))[
        :sequences
    ]:
        rows = model.kernels.log_softmax(model(torch.tensor(prompt + resp)), cfg.vocab_size, 1.0)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(resp))
        ours = rows[at, torch.tensor(resp)].float().view(torch.int32)
        total += len(resp)
        bad += int((ours != torch.tensor(lps, dtype=torch.float32).view(torch.int32)).sum())
    return total, bad
