"""Exact-zero parity: the Megatron trainer's logprobs for responses sampled by the embedded engine
(rollout TP=1) are torch.equal to the engine's decode logprobs, in fp32 and bf16, at TP1, TP2, TP4,
PP2, TP2xPP2, CP2-Ulysses and CP2-ring (plus TP2xCP2-ring). Negative control: the `off_policy`
contract (plain kernels in the engine; megatron's stock local spec, or at CP the kernel spec on the
plain kernels) mismatches at every layout. Real multi-process runs over gloo."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.align import harness
from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.trainer.process_groups import Layout, spawn

pytestmark = pytest.mark.slow  # multi-process trainers at every layout

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    cfg = ModelConfig()
    root = tmp_path_factory.mktemp("ckpt")
    checkpoints, out = {}, {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        checkpoints[name] = str(root / name)
        save_hf(init_state_dict(cfg, dtype, 11), cfg, checkpoints[name])
        for contract, kernels in (("exact", "ordered"), ("off_policy", "plain")):
            # 4 prompts of lengths 40, 37, 34, 31 (ring pads them to 2*CP*tile), 12 new tokens each.
            out[(name, contract)] = harness.rollout(checkpoints[name], kernels, 4, 40, 12, TEMPERATURE)
    return checkpoints, out


def _check(results: list[dict]) -> None:
    for r in results:
        label = f"{r['layout']} {r['dtype']} {r['contract']} ({r['spec']} spec)"
        assert r["tokens"] == 48, label
        assert r["export_equal"] is True, label  # Megatron -> HF export reproduces the checkpoint
        if r["contract"] == "exact":
            assert r["equal"] == 1.0 and r["max_abs_diff"] == 0.0, label
        else:  # rounding noise, not a bug: a broken stock path would not pass this
            eps = 0.05 if r["dtype"] == "bfloat16" else 1e-4
            assert r["equal"] == 0.0 and r["mismatched"] > 0 and 0 < r["max_abs_diff"] < eps, label


def test_parity_two_ranks(rollouts: tuple[dict, dict]) -> None:
    checkpoints, ros = rollouts
    layouts = [Layout(tp=1), Layout(tp=2), Layout(pp=2), Layout(cp=2, cp_type="ulysses"), Layout(cp=2, cp_type="ring")]
    results = spawn(harness.layouts_worker, 2, harness.layout_jobs(layouts, checkpoints, ros, TEMPERATURE))
    assert len(results) == 20
    _check(results)


def test_parity_four_ranks(rollouts: tuple[dict, dict]) -> None:
    checkpoints, ros = rollouts
    layouts = [Layout(tp=4), Layout(tp=2, pp=2), Layout(tp=2, cp=2, cp_type="ring")]
    results = spawn(harness.layouts_worker, 4, harness.layout_jobs(layouts, checkpoints, ros, TEMPERATURE))
    assert len(results) == 12
    _check(results)
