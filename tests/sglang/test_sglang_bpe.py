"""The real-vocabulary example through released SGLang (`python -m tonpolicy experiment=bpe_chat
rollout=sglang`): chat prompts, a byte-level BPE carried by the random-init checkpoint, which SGLang
loads itself (through transformers). Needs the SGLang environment (scripts/setup_sglang.sh). Its
negative control is tests/sglang/test_sglang_real.py::test_off_policy_through_real_sglang_shows_the_mismatch
(the same job machinery, the mismatch shown)."""

from __future__ import annotations

from pathlib import Path

from support.e2e_common import records, run_job, samples, summary


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
