"""Several samples per microbatch, exact: padded rows (micro_batch_size 2) at tp2, pp2, cp2-Ulysses and
cp2-ring, and packed rows (samples concatenated, positions restarting at 0, the contract attention
splitting the row there) at tp2, pp2 and dp2. Every sample's logprobs equal the engine's bit for bit
whatever its neighbours. Negative control: off_policy at the same settings mismatches by rounding."""

from __future__ import annotations

import pytest

from tonpolicy.align import harness
from tonpolicy.config.model import ModelConfig
from tonpolicy.trainer.process_groups import Layout, spawn

pytestmark = pytest.mark.slow  # multi-process trainers

T = 0.8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return harness.checkpoints_and_rollouts(tmp_path_factory.mktemp("mbs"), ModelConfig(), 5, 4, 40, 8, T)


def _run(setup: tuple[dict, dict], layouts: list[Layout], trainer: dict, dtypes: tuple[str, ...]) -> list[dict]:
    cks, ros = setup
    jobs = [dict(j, trainer=trainer) for j in harness.layout_jobs(layouts, {d: cks[d] for d in dtypes}, ros, T)]
    return spawn(harness.layouts_worker, 2, jobs)


def _check(results: list[dict]) -> None:
    for r in results:
        label = f"{r['layout']} {r['dtype']} {r['contract']} ({r['spec']} spec)"
        assert r["tokens"] == 32, label
        if r["contract"] == "exact":
            assert r["equal"] == 1.0 and r["max_abs_diff"] == 0.0, label
            assert r["ranks_equal"] == [1.0, 1.0], label
        else:
            eps = 0.05 if r["dtype"] == "bfloat16" else 1e-4
            assert r["equal"] == 0.0 and 0 < r["max_abs_diff"] < eps, label


def test_padded_microbatches_of_two(setup: tuple[dict, dict]) -> None:
    layouts = [Layout(tp=2), Layout(pp=2), Layout(cp=2, cp_type="ulysses"), Layout(cp=2, cp_type="ring")]
    _check(_run(setup, layouts, {"micro_batch_size": 2}, ("float32", "bfloat16")))


def test_packed_microbatches(setup: tuple[dict, dict]) -> None:
    layouts = [Layout(tp=2), Layout(pp=2), Layout(dp=2)]
    _check(_run(setup, layouts, {"micro_batch_size": 2, "pack_sequences": True}, ("float32", "bfloat16")))


def test_ppo_step_with_microbatches_matches_one_sample_per_microbatch(setup: tuple[dict, dict]) -> None:
    cks, ros = setup
    job = dict(
        layout=Layout(),
        dtype="float32",
        contract="exact",
        checkpoint=cks["float32"],
        rollout=ros[("float32", "exact")],
        temperature=T,
        advantages=[1.0, -0.5, 0.7, -1.2],
    )
    runs = {
        name: spawn(harness.ppo_worker, 1, [dict(job, trainer=tr)])[0]
        for name, tr in (
            ("one", {}),
            ("padded", {"micro_batch_size": 2}),
            ("packed", {"micro_batch_size": 4, "pack_sequences": True}),
        )
    }
    for name, r in runs.items():
        assert r["old_vs_rollout"]["equal"] == 1.0 and r["first_forward_mismatched"] == 0, name
        assert r["update_successful"] == 1.0, name
        # Same loss, other reduction order in the backward (batched GEMMs): fp32 noise only.
        assert abs(r["grad_norm"] / runs["one"]["grad_norm"] - 1) < 1e-5, (name, r["grad_norm"])
