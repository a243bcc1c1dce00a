"""The real-vocabulary example through released SGLang (`python -m tonpolicy experiment=bpe_chat
rollout=sglang`): chat prompts, a byte-level BPE carried by the random-init checkpoint, which SGLang
loads itself (through transformers). Needs the SGLang environment (scripts/setup_sglang.sh). Its
negative control is tests/sglang/test_sglang_real.py::test_off_policy_through_real_sglang_shows_the_mismatch
(the same job machinery, the mismatch shown).

The job runs FP8 rollouts (contract.quant=fp8_block): the contract package inside SGLang quantizes the
master weights it loads and is synced by the one rule, so the fp8 trainer's gate finds 0 mismatched tokens.
SGLang runs at TP 2, where each rank's k/v (64) and gate/up (192) rows cut 128-row weight blocks: the
package's MAX all-reduce of the cut blocks' amaxes gives the unsharded quantization's bits. Control: step
0's rollout logprobs, scored here on the initial weights (unsharded), are the fp8 set's bits and not the
unquantized v2 set's (a package that ignored contract.quant would have sampled the latter).

The same job resumed through SGLang (checkpoint.resume) from its step-1 checkpoint, in a copy of its run
folder, with SGLang at TP 1: SGLang starts from the saved weights and labels the resumed step's samples
with the saved step's version, and the trainer, on the saved weights and optimizer state, finds 0
mismatched tokens. The samples are not the uninterrupted run's: SGLang 0.5.23 honours a request's
sampling_seed only under --enable-deterministic-inference (sampling_batch_info.py; otherwise
torch.multinomial on the server's generator), which needs an accelerator. Bit for bit resume is proven
on the embedded engine (tests/e2e/test_e2e_resume.py, with its control)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support.e2e_common import records, run_job, samples, summary

from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import load_hf

SHORT = ("experiment.steps=2", "experiment.prompts_per_step=2", "experiment.max_new_tokens=3")
SMALL = (*SHORT, "experiment.max_prompt_len=24", "experiment.top_k=16", "task.graded_tokens=1")
JOB = (
    "experiment=bpe_chat",
    "rollout=sglang",
    "trainer.device=cpu",
    *SMALL,
    "rollout.skip_tokenizer_init=false",
    "contract.quant=fp8_block",
    "parallel.rollout_tp=2",  # SGLang TP 2: k/v's 64 and gate/up's 192 rows per rank cut 128-row fp8 blocks
    "checkpoint.save_every=1",  # step 1's checkpoint: what the resume starts from
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, sglang_py: str) -> Path:
    proc, run_dir = run_job(tmp_path_factory.mktemp("bpe_sglang"), *JOB, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def test_bpe_chat_through_real_sglang_is_exact(run_dir: Path) -> None:
    """Exact zero on every step and every token; the rewards read the decoded answers without error."""
    recs = records(run_dir)
    assert summary(run_dir)["status"] == "ok" and [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert r["mismatched_tokens"] == 0 and r["max_abs_logprob_diff"] == 0.0 and r["tokens_scored"] > 0, r
        assert r["reward_errors"] == 0, r
    texts = [t for step in samples(run_dir) for t in step["prompt_texts"]]
    assert texts and all(t.startswith("<|im_start|>user\nIs ") for t in texts), texts[:2]
    fp8, v2 = (_mismatched(run_dir, quant) for quant in ("fp8_block", "none"))
    assert fp8[0] == v2[0] > 0 and fp8[1] == 0 and v2[1] > 0, (fp8, v2)


def test_resumed_through_sglang_from_step_1_is_exact_on_the_saved_version(run_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "run"
    shutil.copytree(run_dir, again)
    # At SGLang TP 1: the rollout's layout is not the trainer's, so a resume may change it (and a TP 1
    # server starts sooner); the fp8 bits are every rollout TP's.
    job = [o if o != "parallel.rollout_tp=2" else "parallel.rollout_tp=1" for o in JOB]
    proc, _ = run_job(tmp_path, *job, f"checkpoint.resume={again / 'checkpoints' / 'step_1'}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming after step 0" in proc.stderr
    recs = records(again)
    assert [r["step"] for r in recs] == [0, 1], recs
    # Step 0's line kept as the original wrote it. Compared as text: a parsed NaN (json's NaN, e.g. a
    # grad_norm where no update ran) is unequal to itself, so parsed records could differ where the lines do not.
    kept, first = ((d / "metrics.jsonl").read_text().splitlines()[0] for d in (again, run_dir))
    assert kept == first, {k: (v, recs[0].get(k)) for k, v in records(run_dir)[0].items() if recs[0].get(k) != v}
    assert recs[1]["gate"] == "passed" and recs[1]["mismatched_tokens"] == 0 and recs[1]["tokens_scored"] > 0
    assert recs[1]["max_abs_logprob_diff"] == 0.0, recs[1]
    # a server started on the saved weights reports "default" until it is told their version
    versions = {v for sample in samples(again)[1]["weight_versions"] for v in sample}
    assert versions == {"step_1"}, versions
    assert (again / "checkpoints" / "step_2" / "trainer_state.json").is_file()


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
