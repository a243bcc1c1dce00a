"""The PPO step without the "old logprob" recompute, and with several minibatches and epochs (one rank,
fp32, kernel spec): PPO's old logprobs are the rollout's, and the first training forward reproduces them
bit for bit, so the ratio is exactly 1 there; with trainer.ppo_minibatches=2 and ppo_epochs=2 the step
makes four updates and the gate's check saw the first minibatch's forward, the one before any update; a
rollout logprob one bit off refuses the step's every update (the weights are unchanged). The off_policy
control's ratio is not 1 at the first forward."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.align import harness
from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.trainer.process_groups import Layout, spawn

pytestmark = pytest.mark.slow  # a spawned trainer

T = 0.8
ADV = [1.0, -0.5, 0.7, -1.2]


def _job(ck: str, ro: dict, contract: str = "exact", **trainer: int) -> dict:
    # old_from_rollout: PPO's old logprobs are the rollout's (no recompute); exact_first_forward: the gate
    # refuses the update when the first training forward differs from them by a bit
    return dict(
        layout=Layout(tp=1),
        dtype="float32",
        contract=contract,
        checkpoint=ck,
        rollout=ro,
        temperature=T,
        advantages=ADV,
        trainer=trainer,
        old_from_rollout=True,
        exact_first_forward=contract == "exact",
    )


def test_rollout_logprobs_as_old_ratio_one_minibatches_and_a_planted_mismatch(tmp_path: pytest.TempPathFactory) -> None:
    cfg = ModelConfig()
    ck = str(tmp_path / "fp32")
    save_hf(init_state_dict(cfg, torch.float32, 11), cfg, ck)
    ro = harness.rollout(ck, "ordered", 4, 24, 8, T)
    ro_off = harness.rollout(ck, "plain", 4, 24, 8, T)
    planted = dict(ro, logprobs=[torch.as_tensor(x, dtype=torch.float32).clone() for x in ro["logprobs"]])
    planted["logprobs"][0].view(torch.int32)[0] ^= 1
    one, many, refused, off = spawn(
        harness.ppo_worker,
        1,
        [
            _job(ck, ro),
            _job(ck, ro, ppo_minibatches=2, ppo_epochs=2),
            _job(ck, planted, ppo_minibatches=2),
            _job(ck, ro_off, "off_policy"),
        ],
    )
    # One minibatch: every sample's first forward == the rollout's logprobs, so the ratio is exactly 1.
    assert one["first_forward_mismatched"] == 0 and one["first_forward_max_abs_diff"] == 0.0
    assert one["ratio_min"] == one["ratio_max"] == 1.0 and one["clipfrac"] == 0.0
    assert one["update_successful"] == 1.0 and one["grad_norm"] > 0 and "updates" not in one
    # Two minibatches x two epochs: four updates; the first minibatch's forward preceded them all and was
    # exact (its ratio 1); the second's ran after the first update, so the ratio over all first forwards moved.
    assert many["updates"] == 4 and len(many["grad_norms"]) == len(many["minibatch_losses"]) == 4
    assert many["first_forward_mismatched"] == 0 and many["update_successful"] == 1.0
    assert many["grad_norm"] == many["grad_norms"][0] > 0
    assert (many["ratio_min"], many["ratio_max"]) != (1.0, 1.0)
    # More updates move the policy further than one (the post-step logprobs differ from the single update's).
    assert any(not torch.equal(a, b) for a, b in zip(one["new_logprobs"], many["new_logprobs"], strict=True))
    # A planted one-bit mismatch in the first minibatch: no update at all, the weights are the rollout's.
    assert refused["first_forward_mismatched"] == 1 and refused["update_successful"] == 0.0
    assert refused["grad_norm"] != refused["grad_norm"]  # NaN: no update was made
    assert harness.compare(refused["new_logprobs"], ro["logprobs"])["equal"] == 1.0
    # Negative control: plain kernels both sides, old = the rollout's: the ratio is not 1 at the first forward.
    assert (off["ratio_min"], off["ratio_max"]) != (1.0, 1.0)
