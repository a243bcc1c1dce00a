"""Released SGLang on the contract, on this CPU: the model package gives the contract's bits.

Each server is started with the command and environment tonpolicy's launch plan renders. The check
drives it like GRPO (concurrent requests, shared prompts served from the radix cache, chunked prefill)
and compares every returned logprob with tonpolicy's own full-forward scoring, fp32 bit for bit.
Negative control: stock SGLang (its own Qwen3 and kernels) on the same check and checkpoint differs
by a small non-zero amount. These tests need the SGLang environment (scripts/setup_sglang.sh).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from support.e2e_common import records, run_job, samples, summary
from support.sglang_proc import SGLangServer, check_parity

from tonpolicy.config.compose import compose_config
from tonpolicy.config.model import ModelConfig
from tonpolicy.contract.handshake import handshake
from tonpolicy.contract.identity import runtime_identity
from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf


@pytest.fixture
def fp32_server(contract_fp32_server: SGLangServer, fp32_ckpt: Path) -> tuple[SGLangServer, Path]:
    """The folder's fp32 TP 1 contract server (tests/sglang/conftest.py) and its checkpoint."""
    return contract_fp32_server, fp32_ckpt


def _package_gives_the_contract_bits(
    scorer_py: str, server: SGLangServer, ckpt: Path, dtype: str, rollout_tp: int, temperature: float
) -> None:
    result = check_parity(scorer_py, server, ckpt, "ordered", temperature)
    reported = server.client.contract()
    assert result["tokens"] == 20 * 20 and result["mismatched"] == 0 and result["max_abs_diff"] == 0.0, result
    assert result["cached_tokens"] > 0, "the radix cache served no prefix: the check lost its point"
    # The runtime identity is the server's own (its kernel set, its dtype), and under v2 it carries the
    # kernel library, not SGLang's torch build: it equals the one computed here, under another torch.
    assert reported["runtime"]["dtype"] == dtype and set(reported["runtime"]["build"]) == {"device", "kernel_library"}
    assert reported["runtime"] == runtime_identity(get_kernels("ordered"), dtype, "cpu"), reported["runtime"]
    assert reported["tp_size"] == rollout_tp


def test_model_package_gives_the_contract_bits_fp32_tp1(fp32_server: tuple[SGLangServer, Path], sglang_py: str) -> None:
    _package_gives_the_contract_bits(sglang_py, *fp32_server, "float32", 1, 1.0)


def test_model_package_gives_the_contract_bits_bf16_tp2(tmp_path: Path) -> None:
    """Scored under .venv's torch build (the CPU 2.13.0) against the server's (SGLang's 2.14.1): v2's bits
    are its definition's, whatever torch build (and whatever CPU vector path) computes them.
    The checkpoint is in the published FP8 format (weight + weight_scale_inv, quantization_config fp8):
    SGLang hands the package its own Fp8Config, which must select none of SGLang's kernels, and the
    package reads the pairs back into the master weights tonpolicy's loader (the scorer's) reads.
    Control: the masters the FP8 pairs came from score the same server's tokens with mismatches."""
    cfg = ModelConfig()
    masters = init_state_dict(cfg, torch.bfloat16, 0)
    save_hf(masters, cfg, tmp_path / "masters")
    ckpt = tmp_path / "ckpt"
    save_hf(masters, cfg, ckpt, quant="fp8_block")
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    overrides = ["contract.dtype=bfloat16", "parallel.rollout_tp=2", "rollout.chunked_prefill_size=64"]
    server = SGLangServer(tmp_path, "contract", ckpt, overrides)
    try:
        server.start_healthy()
        _package_gives_the_contract_bits(sys.executable, server, ckpt, "bfloat16", 2, 0.7)
        control = check_parity(sys.executable, server, tmp_path / "masters", "ordered", 0.7, small=True)
        assert control["tokens"] > 0 and control["mismatched"] > 0, control
    finally:
        server.stop()


def test_trainer_on_another_torch_build_pairs_under_v2_not_under_v1(
    fp32_server: tuple[SGLangServer, Path], sglang_py: str
) -> None:
    """The handshake compares runtime fingerprints. Under v2 a trainer on .venv's torch build (the CPU
    2.13.0) pairs with the server on SGLang's (2.14.1): the fingerprint carries the definition and its
    code, not the host (test_model_package_gives_the_contract_bits_bf16_tp2 shows the bits agree). Under
    v1, whose row-local ops are torch's, the same two builds differ in the fingerprint (the handshake
    would refuse); a trainer with another dtype is refused under either."""
    server, _ = fp32_server
    cfg = compose_config(["rollout=sglang", "trainer.device=cpu", "contract.dtype=float32"])
    ours = runtime_identity(get_kernels("ordered"), cfg.contract.dtype, "cpu")
    assert handshake(cfg, server.client, ours) is None
    other_dtype = runtime_identity(get_kernels("ordered"), "bfloat16", "cpu")
    refusal = handshake(cfg, server.client, other_dtype)
    assert refusal is not None and "runtime fingerprint mismatch" in refusal and "'dtype'" in refusal
    v1 = (
        "import json; from tonpolicy.contract.identity import runtime_identity as r; "
        "from tonpolicy.kernels import get_kernels as k; print(json.dumps(r(k('invariant'), 'float32', 'cpu')))"
    )
    theirs_v1 = json.loads(subprocess.run([sglang_py, "-c", v1], capture_output=True, text=True, check=True).stdout)
    ours_v1 = runtime_identity(get_kernels("invariant"), "float32", "cpu")
    assert (
        ours_v1["build"]["torch"] != theirs_v1["build"]["torch"] and ours_v1["fingerprint"] != theirs_v1["fingerprint"]
    )


def test_out_of_vocab_ids_are_refused_not_fatal(fp32_server: tuple[SGLangServer, Path]) -> None:
    """Released SGLang dies on a token id past the vocabulary (IndexError in its scheduler); with the
    contract package's server a 400 answers it, like the embedded server, and the server keeps serving."""
    server, _ = fp32_server
    bad = urllib.request.Request(
        f"{server.url}/generate", json.dumps({"input_ids": [[1, 2], [3, 999999]]}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=60)
    assert refused.value.code == 400 and b"input_ids must be in [0, 2003)" in refused.value.read()
    good = server.client.generate([[1, 2, 3]], {"max_new_tokens": 3})
    assert len(good[0]["output_ids"]) == 3 and server.proc.poll() is None


def test_stock_sglang_is_close_but_not_exact(stock_fp32_server: SGLangServer, fp32_ckpt: Path, sglang_py: str) -> None:
    """Negative control: the same check against SGLang's own model and kernels."""
    result = check_parity(sglang_py, stock_fp32_server, fp32_ckpt, "ordered", 1.0)
    assert stock_fp32_server.client.contract() is None  # stock SGLang reports no tonpolicy contract
    assert result["mismatched"] > 0 and 0 < result["max_abs_diff"] < 1e-3, result


IDS = list(range(3, 2000, 13))  # token-id logprobs asked of every row: many values per row
PROMPTS = [[11, 200, 37, 45, 900, 13, 7], list(range(20, 60)), [5]]
# Prefill-only gives one row per request; rows whose two recipes round alike are common: many requests.
SCORED = [[(7 * i + 13 * j) % 2000 for j in range(3 + i)] for i in range(24)]


def _reported(url: str, prefill_only: bool) -> list[tuple[list[int], list[int], list[tuple[int, int, float]]]]:
    """A greedy batch (sampled, prompt, top-k and token-id logprobs), or the same prompts as /v1/score sends
    them (max_new_tokens 0, no prompt logprobs: the next token's top-k and token-id logprobs): per request
    its prompt, response and (row, token, logprob) for every value reported."""
    sampling = {"max_new_tokens": 0 if prefill_only else 6, "temperature": 0}
    body = {"input_ids": PROMPTS, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 4,
            "token_ids_logprob": IDS, "logprob_start_len": -1 if prefill_only else 0}  # fmt: skip
    prompts = body["input_ids"] = SCORED if prefill_only else PROMPTS
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    out = []
    for prompt, item in zip(prompts, json.loads(urllib.request.urlopen(req, timeout=300).read()), strict=True):
        mi, resp = item["meta_info"], item["output_ids"]
        seen = [(len(prompt) - 1 + i, t, lp) for i, (lp, t, _) in enumerate(mi["output_token_logprobs"])]
        keys = [("output_", len(prompt) - 1)]
        if not prefill_only:  # prompt logprobs from position 0: row i - 1 gives token i
            seen += [(i, t, lp) for i, (lp, t, _) in enumerate(mi["input_token_logprobs"][1:])]
            keys.append(("input_", -1))
        for key, first in keys:
            for kind in ("top_logprobs", "token_ids_logprobs"):
                for i, row in enumerate(mi[key + kind]):
                    seen += [(first + i, t, lp) for lp, t, _ in row or [] if first + i >= 0]
        out.append((prompt, resp, seen))
    return out


@pytest.mark.parametrize("prefill_only", [False, True], ids=["greedy", "prefill_only"])
def test_greedy_and_prefill_only_logprobs_are_the_recipe(
    fp32_server: tuple[SGLangServer, Path], stock_fp32_server: SGLangServer, prefill_only: bool
) -> None:
    """Every logprob a v2 server reports for a greedy batch (sampled, prompt, top-k, token-id) and for a
    prefill-only batch (SGLang's /v1/score route) is v2's log-softmax of tonpolicy's full-forward logits,
    bit for bit. Controls: torch's log_softmax of the same exact logits (SGLang's recipe on the contract's
    logits) misses some of them, so a route left to SGLang would fail; stock SGLang misses."""
    server, ckpt = fp32_server
    cfg, sd = load_hf(str(ckpt))
    model = resolve(family(cfg.family).engine_model)(cfg, get_kernels("ordered"), torch.float32, sd)

    def mismatched(url: str) -> tuple[int, int, int]:
        total = ours = torchs = 0
        for prompt, resp, seen in _reported(url, prefill_only):
            logits = model(torch.tensor(prompt + resp))
            rows = model.kernels.log_softmax(logits, cfg.vocab_size, 1.0).view(torch.int32)
            plain = torch.log_softmax(logits[:, : cfg.vocab_size].float(), -1).view(torch.int32)
            at, tok = torch.tensor([i for i, _, _ in seen]), torch.tensor([t for _, t, _ in seen])
            got = torch.tensor([lp for _, _, lp in seen], dtype=torch.float32).view(torch.int32)
            total += len(seen)
            ours += int((rows[at, tok] != got).sum())
            torchs += int((plain[at, tok] != got).sum())
        return total, ours, torchs

    total, ours, torchs = mismatched(server.url)
    assert total > 400 and ours == 0 and torchs > 0, (total, ours, torchs)
    total, ours, _ = mismatched(stock_fp32_server.url)
    assert total > 400 and ours > 0, (total, ours)


def _run(tmp_path: Path, *overrides: str):
    steps = () if any(o.startswith("experiment.steps=") for o in overrides) else ("experiment.steps=2",)
    proc, run_dir = run_job(tmp_path, "rollout=sglang", "trainer.device=cpu", *steps, *overrides, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return records(run_dir), summary(run_dir)


def test_multi_turn_run_through_real_sglang_is_exact_with_weight_sync(tmp_path: Path, sglang_py: str) -> None:
    """`python -m tonpolicy rollout=sglang parallel=tp2 task=calculator`: released SGLang (its radix cache
    on, as by default) serves the multi-turn tool task on the contract package; every model token of every
    turn is gated with exact zero, later turns come from SGLang's prefix cache (meta_info.cached_tokens),
    and the weights are synced between the steps. The embedded engine's cache on/off and decode- vs
    prefill-written K/V are proven with their controls in tests/engine/test_prefix_cache.py; the
    multi-turn control in tests/e2e/test_e2e_multi_turn.py."""
    calculator = ("task=calculator", "task.graded_tokens=1", "task.max_turns=3", "experiment.max_new_tokens=4")
    recs, s = _run(tmp_path, "parallel=tp2", *calculator)
    assert [r["step"] for r in recs] == [0, 1] and s["status"] == "ok"
    for r in recs:
        assert r["tokens_scored"] == r["model_tokens"] >= 24 and r["mismatched_tokens"] == 0, r
        assert r["max_abs_logprob_diff"] == 0.0 and r["cached_tokens"] > 0, r


def test_rollout_tp_differs_from_trainer_layout_one_step_stale(tmp_path: Path, sglang_py: str) -> None:
    """SGLang at TP 2 against the trainer at ring CP 2 (TP 1), asynchronous (experiment.max_staleness=1):
    the same bits under the version that sampled each token, which SGLang labels itself
    (meta_info.weight_versions); weights pushed over a process group of the trainer's rank 0 and both
    SGLang TP ranks (SGLang's own endpoints), between the producer's requests."""
    layout = ("parallel=cp2_ring", "parallel.rollout_tp=2", "rollout.weight_sync=distributed")
    recs, s = _run(tmp_path, *layout, "experiment.max_staleness=1", "experiment.steps=3")
    assert s["mismatched_tokens"] == 0 and all(r["mismatched_tokens"] == 0 for r in recs), recs
    assert len(recs) == 3 and all(r["gate"] == "passed" for r in recs)
    # GRPO: a step updates the weights exactly when some prompt's samples got different rewards (which
    # version sampled them, and so the rewards, depends on timing); at least one step does.
    learnt = [_some_group_differs(step) for step in samples(tmp_path / "run")]
    assert [r["grad_norm"] > 0 for r in recs] == learnt and any(learnt), (recs, learnt)
    assert [r["trainer_policy_version"] for r in recs] == [0, 1, 2]
    for r in recs[1:]:  # the producer starts batch j while step j-1 trains: its first requests are stale
        assert "1" in r["staleness"] and sum(r["staleness"].values()) == r["tokens_scored"], r
        versions = {f"step_{r['step'] - 1}" if r["step"] > 1 else "default", f"step_{r['step']}"}
        assert set(r["weight_versions"]) <= versions, r


def _some_group_differs(step: dict) -> bool:
    groups: dict[str, set[float]] = {}
    for prompt, reward in zip(step["prompts"], step["rewards"], strict=True):
        groups.setdefault(json.dumps(prompt), set()).add(reward)
    return any(len(rewards) > 1 for rewards in groups.values())


def test_off_policy_through_real_sglang_shows_the_mismatch(tmp_path: Path, sglang_py: str) -> None:
    recs, s = _run(tmp_path, "contract=off_policy", "parallel=tp1")
    assert s["status"] == "ok"
    assert all(r["mismatched_tokens"] > 0 and 0 < r["max_abs_logprob_diff"] < 0.05 for r in recs), recs
