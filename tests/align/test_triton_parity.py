"""The `triton` kernel set end to end through both engines, in Triton's interpreter (fp32; on a GPU,
experiments/gpu/triton_check.py runs the same in bf16): the embedded engine's decode logprobs equal
a full-sequence prefill of the same model, and the Megatron trainer (real gloo process groups) at
TP1, TP2 and CP2-ring reproduces them bit for bit. Negative control: the `off_policy` contract
(plain kernels) mismatches at the same layouts. The same under contract.quant=fp8_block (`triton_fp8`: e4m3
GEMMs, triton/fp8_linear.py) at TP1 and TP2, where the k/v weights' 128-row blocks and gate/up's second block
are cut between the ranks (their amax all-reduced); its control: the unquantized triton trainer against
the FP8 rollout mismatches."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.align import harness
from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
from tonpolicy.model.qwen3 import Qwen3
from tonpolicy.trainer.process_groups import Layout, spawn

pytestmark = [
    pytest.mark.slow,  # Triton's interpreter through both engines at several layouts
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
TEMPERATURE = 0.8
MODEL = ModelConfig(num_layers=1)  # the interpreter is slow; one layer has every kernel


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    ck = str(tmp_path_factory.mktemp("ckpt") / "float32")
    save_hf(init_state_dict(MODEL, torch.float32, 5), MODEL, ck)
    ros = {
        ("float32", c): harness.rollout(ck, k, 3, 40, 6, TEMPERATURE)
        for c, k in (("triton", "triton"), ("off_policy", "plain"))
    }
    ros[("float32", "triton_fp8")] = harness.rollout(ck, "triton", 2, 9, 3, TEMPERATURE, quant="fp8_block")
    return {"float32": ck}, ros


@pytest.mark.parametrize("contract,quant", [("triton", "none"), ("triton_fp8", "fp8_block")])
def test_engine_decode_equals_prefill(setup: tuple[dict, dict], contract: str, quant: str) -> None:
    cks, ros = setup
    ro = ros[("float32", contract)]
    cfg, sd = load_hf(cks["float32"])
    kern = get_kernels("triton", attention_tile=64, quant=quant)
    model = Qwen3(cfg, kern, torch.float32, sd)
    for p, r, lps in zip(ro["prompts"], ro["responses"], ro["logprobs"], strict=True):
        ids = torch.tensor(p + r)
        logits = model(ids)[len(p) - 1 : -1]
        got = kern.logprobs(logits, torch.tensor(r), cfg.vocab_size, TEMPERATURE)
        assert torch.equal(got, torch.tensor(lps, dtype=torch.float32))


def test_trainer_matches_engine_bitwise(setup: tuple[dict, dict]) -> None:
    cks, ros = setup
    layouts = [Layout(tp=1), Layout(tp=2), Layout(cp=2, cp_type="ring")]
    jobs = harness.layout_jobs(layouts, cks, ros, TEMPERATURE, contracts=("triton", "off_policy"))
    fp8 = harness.layout_jobs(layouts[:2], cks, ros, TEMPERATURE, contracts=("triton_fp8",))
    control = {**fp8[0], "contract": "triton"}  # the unquantized trainer against the FP8 rollout
    results = spawn(harness.layouts_worker, 2, jobs + fp8 + [control])
    assert len(results) == 9
    for r in results[:6]:
        label = f"{r['layout']} {r['contract']} ({r['spec']} spec)"
        assert r["tokens"] == 18, label
        if r["contract"] == "triton":
            assert r["equal"] == 1.0 and r["max_abs_diff"] == 0.0, label
        else:  # fp32 rounding noise
            assert r["equal"] == 0.0 and r["mismatched"] > 0 and 0 < r["max_abs_diff"] < 1e-4, label
    for r in results[6:8]:
        assert r["contract"] == "triton_fp8" and r["tokens"] == 6, r
        assert r["equal"] == 1.0 and r["max_abs_diff"] == 0.0 and r["ranks_equal"] == [1.0, 1.0], r
    c = results[8]  # FP8 changes the numerics: only the shared definition makes them equal
    assert c["equal"] == 0.0 and c["mismatched"] > 0 and 0 < c["max_abs_diff"] < 1.0, c
