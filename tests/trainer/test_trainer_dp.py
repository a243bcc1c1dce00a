"""Real data parallelism: each DP replica scores and trains on its own share of the batch (round
robin), Megatron's DDP reduces the gradients, results are gathered so every rank holds the whole
batch. Exact zero on every rank at dp2, dp2 x tp2 and dp2 x cp2 (both CP modes); grad_norm at dp2
equals dp1's within fp32 reduction noise. Negative control: off_policy at dp2 mismatches by rounding."""

from __future__ import annotations

import pytest

from tonpolicy.align import harness
from tonpolicy.config.model import ModelConfig
from tonpolicy.trainer.process_groups import Layout, spawn

pytestmark = pytest.mark.slow  # multi-process trainers

T = 0.8
ADV = [1.0, -0.5, 0.7, -1.2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return harness.checkpoints_and_rollouts(tmp_path_factory.mktemp("dp"), ModelConfig(), 21, 4, 36, 8, T)


def _check(results: list[dict]) -> None:
    for r in results:
        label = f"{r['layout']} {r['dtype']} {r['contract']}"
        if r["contract"] == "exact":
            assert r["equal"] == 1.0 and r["max_abs_diff"] == 0.0, label
            assert r["ranks_equal"] == [1.0] * len(r["ranks_equal"]), label  # every rank, not only rank 0
        else:
            eps = 0.05 if r["dtype"] == "bfloat16" else 1e-4
            assert r["equal"] == 0.0 and 0 < r["max_abs_diff"] < eps, label


def test_dp2_exact(setup: tuple[dict, dict]) -> None:
    cks, ros = setup
    results = spawn(harness.layouts_worker, 2, harness.layout_jobs([Layout(dp=2)], cks, ros, T))
    assert len(results) == 4
    _check(results)


def test_dp2_with_tp2_and_cp2_exact(setup: tuple[dict, dict]) -> None:
    cks, ros = setup
    layouts = [Layout(tp=2, dp=2), Layout(cp=2, cp_type="ulysses", dp=2), Layout(cp=2, cp_type="ring", dp=2)]
    results = spawn(harness.layouts_worker, 4, harness.layout_jobs(layouts, {"float32": cks["float32"]}, ros, T))
    assert len(results) == 6
    _check(results)


def test_dp2_trains_on_shares_with_dp1_grad_norm(setup: tuple[dict, dict]) -> None:
    cks, ros = setup
    ck, ro = cks["float32"], ros[("float32", "exact")]

    def job(layout: Layout) -> dict:
        return dict(
            layout=layout,
            dtype="float32",
            contract="exact",
            checkpoint=ck,
            rollout=ro,
            temperature=T,
            advantages=ADV,
        )

    (dp1,) = spawn(harness.ppo_worker, 1, [job(Layout())])
    (dp2,) = spawn(harness.ppo_worker, 2, [job(Layout(dp=2))])
    assert dp1["shares"] == [[0, 1, 2, 3]]
    assert dp2["shares"] == [[0, 2], [1, 3]]  # each sample trained on by exactly one replica
    for r in (dp1, dp2):
        assert r["old_vs_rollout"]["equal"] == 1.0 and r["first_forward_mismatched"] == 0
    print("grad_norm dp1", repr(dp1["grad_norm"]), "dp2", repr(dp2["grad_norm"]))
    assert abs(dp2["grad_norm"] / dp1["grad_norm"] - 1) < 1e-6  # DDP's reduction order: fp32 noise
    diff = max(float((a - b).abs().max()) for a, b in zip(dp1["new_logprobs"], dp2["new_logprobs"], strict=True))
    assert diff < 1e-4
