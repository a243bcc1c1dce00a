"""One PPO/GRPO step through megatron's schedules, DDP and optimizer at several layouts on the same
batch (fp32, kernel spec). Before the update the trainer reproduces the rollout exactly (ratio 1,
zero train/rollout diff); grad_norm agrees with TP1's within 1e-6 relative at PP2 and CP2 and 1e-5 at
TP2/TP4 (backward reductions are not under the contract). The
off_policy control shows a non-zero train/rollout diff."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.align import harness
from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.trainer.process_groups import Layout, spawn

pytestmark = pytest.mark.slow  # multi-process trainers

T = 0.8
ADV = [1.0, -0.5, 0.7, -1.2]


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict, str, dict]:
    cfg = ModelConfig()
    root = tmp_path_factory.mktemp("ppo")
    ck, ck16 = str(root / "fp32"), str(root / "bf16")
    save_hf(init_state_dict(cfg, torch.float32, 11), cfg, ck)
    save_hf(init_state_dict(cfg, torch.bfloat16, 11), cfg, ck16)
    return (
        ck,
        harness.rollout(ck, "ordered", 4, 40, 12, T),
        harness.rollout(ck, "plain", 4, 40, 12, T),
        ck16,
        harness.rollout(ck16, "ordered", 4, 40, 12, T),
    )


def _jobs(ck: str, ro: dict, layouts: list[Layout], contract: str = "exact", dtype: str = "float32") -> list[dict]:
    return [
        dict(layout=lay, dtype=dtype, contract=contract, checkpoint=ck, rollout=ro, temperature=T, advantages=ADV)
        for lay in layouts
    ]


def _on_policy(r: dict) -> None:
    assert r["old_vs_rollout"]["equal"] == 1.0, r["layout"]
    assert r["train_rollout_logprob_abs_diff"] == 0.0 and r["train_rollout_k3_kl"] == 0.0
    assert r["token_mult_prob_error"] == 1.0 and r["clipfrac"] == 0.0
    assert r["ratio_min"] == r["ratio_max"] == 1.0
    # Three-way: rollout == recompute (above) == the first training forward (autograd on), bit for bit.
    assert r["first_forward_mismatched"] == 0 and r["first_forward_max_abs_diff"] == 0.0
    assert r["update_successful"] == 1.0 and r["grad_norm"] > 0


def test_ppo_step_two_ranks(batch: tuple) -> None:
    ck, ro, ro_off, ck16, ro16 = batch
    layouts = [Layout(tp=1), Layout(tp=2), Layout(pp=2), Layout(cp=2, cp_type="ulysses"), Layout(cp=2, cp_type="ring")]
    res = spawn(
        harness.ppo_worker,
        2,
        _jobs(ck, ro, layouts)
        + _jobs(ck16, ro16, [Layout(tp=2)], dtype="bfloat16")
        + _jobs(ck, ro_off, [Layout(tp=1)], "off_policy")
        + [dict(_jobs(ck, ro_off, [Layout(tp=1)], "off_policy")[0], old_from_rollout=True, exact_first_forward=True)],
    )
    bf16, off, refused = res[-3], res[-2], res[-1]
    res = res[:-3]
    ref = res[0]
    for r in res + [bf16]:
        _on_policy(r)  # bf16 too: the bf16 optimizer path, ratio exactly 1 before the update
    by = {str(r["layout"]): r for r in res}
    for name, r in by.items():
        print(name, "grad_norm", repr(r["grad_norm"]), "step_s", round(r["step_s"], 3))
    # The backward is not under the contract, and the layouts sum gradients in other orders: TP1 here is
    # two data-parallel replicas (samples [0, 2] and [1, 3], then the all-reduce), PP2 and CP2 one replica
    # over all four; PP adds the tied embedding's two contributions across stages; ring CP computes the
    # attention gradient blockwise. So grad_norm agrees to fp32 rounding, not bit for bit (on an AVX512
    # CPU the fp32 norm happened to round alike at PP2 and CP2-Ulysses; on an AMX CPU it does not).
    for name in ("pp2", "cp2_ulysses", "cp2_ring"):
        assert abs(by[name]["grad_norm"] / ref["grad_norm"] - 1) < 1e-6, name
    for name, r in by.items():
        # After the Adam step the weights agree to fp32 rounding (grad summation order differs, e.g. the
        # tied embedding's two contributions under PP); the new logprobs agree closely.
        diff = max(float((a - b).abs().max()) for a, b in zip(r["new_logprobs"], ref["new_logprobs"], strict=True))
        print(name, "post-step logprob max|diff| vs TP1", diff)
        assert diff < 1e-4, name
    assert abs(by["tp2"]["grad_norm"] / ref["grad_norm"] - 1) < 1e-5
    # The update moved the policy.
    assert not all(torch.equal(a, b) for a, b in zip(ref["new_logprobs"], ro["logprobs"], strict=True))
    # Negative control: plain kernels on both sides, so the trainer does not reproduce the rollout.
    assert off["spec"] == "stock" and off["old_vs_rollout"]["equal"] == 0.0
    assert 0 < off["old_vs_rollout"]["max_abs_diff"] < 1e-4  # fp32 rounding noise, not a bug
    assert off["train_rollout_logprob_abs_diff"] > 0 and off["token_mult_prob_error"] > 1.0
    # Control for the first-forward check: "old" logprobs that are not the recompute (the plain engine's)
    # are caught, by a rounding-sized difference, and the update is refused.
    assert refused["first_forward_mismatched"] > 0 and 0 < refused["first_forward_max_abs_diff"] < 1e-4
    assert refused["update_successful"] == 0.0


def test_ppo_step_four_ranks(batch: tuple) -> None:
    ck, ro = batch[0], batch[1]
    res = spawn(harness.ppo_worker, 4, _jobs(ck, ro, [Layout(tp=1), Layout(tp=4), Layout(tp=2, pp=2)]))
    ref = res[0]
    for r in res:
        _on_policy(r)
        print(r["layout"], "grad_norm", repr(r["grad_norm"]), "step_s", round(r["step_s"], 3))
        assert abs(r["grad_norm"] / ref["grad_norm"] - 1) < 1e-5, r["layout"]
