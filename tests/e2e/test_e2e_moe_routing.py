"""End to end on qwen3_moe_tiny at EP 2 (the README's MoE parity smoke): routing agreement as the gate
records it. The contract routes every token as the rollout did and matches its bits (agreement 1.0, 0
mismatched, every step); the off-policy control's stock router disagrees on some routes (agreement < 1,
mismatched > 0); with router replay it takes the rollout's routes (agreement 1.0) and its bits still
differ (mismatched > 0): routing is one source of the mismatch, not the only one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.e2e_common import records, run_sweep, summary

MOE_SMOKE = ["model=qwen3_moe_tiny", "parallel=ep2", "experiment=parity_smoke", "logger=none"]


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    run_dir = tmp_path / name
    argv = [sys.executable, "-m", "tonpolicy", "mode=run", *MOE_SMOKE, *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "routing_agree" in proc.stdout  # the final table's column
    return records(run_dir)


def test_contract_sweep_routes_as_the_rollout_every_step(tmp_path: Path) -> None:
    """`python -m tonpolicy -m model=qwen3_moe_tiny parallel=tp1,ep2,tp2_ep2,pp2_ep2`: every layout exact,
    routes agreeing, on both steps (the second after weight sync); the sweep writes its parity matrix."""
    layouts = ["tp1", "ep2", "tp2_ep2", "pp2_ep2"]
    overrides = [o for o in MOE_SMOKE if not o.startswith("parallel=")]
    sweep, jobs = run_sweep(tmp_path, layouts, [*overrides, "experiment.steps=2"])
    for job in jobs:
        recs = records(job)
        assert [r["step"] for r in recs] == [0, 1], job.name
        for r in recs:
            assert r["tokens_scored"] > 0 and r["mismatched_tokens"] == 0 and r["routing_agreement"] == 1.0, r
        assert summary(job)["min_routing_agreement"] == 1.0
    table = (sweep / "sweep_summary.md").read_text()
    assert all(layout in table for layout in layouts)
    assert (sweep / "sweep_summary.png").stat().st_size > 1000


def test_off_policy_stock_router_disagrees_on_some_routes(tmp_path: Path) -> None:
    stock = _run(tmp_path, "stock", "contract=off_policy", "experiment.steps=1")[0]
    assert stock["mismatched_tokens"] > 0 and 0.0 < stock["routing_agreement"] < 1.0, stock


def test_off_policy_replay_aligns_the_routes_but_not_the_bits(tmp_path: Path) -> None:
    replay = _run(tmp_path, "replay", "contract=off_policy", "trainer.router_replay=true", "experiment.steps=1")[0]
    assert replay["mismatched_tokens"] > 0 and replay["routing_agreement"] == 1.0, replay
    # the training forward replays the same routes: the first PPO ratio is the recompute's
    assert replay["first_forward_mismatched"] == 0, replay
