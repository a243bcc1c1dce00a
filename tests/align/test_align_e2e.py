"""`mode=align` end to end: the embedded engine's decode path against Megatron's forward (real gloo
processes) at TP1 (the CLI, as a user runs it), TP2 and zigzag-ring CP2, with a perturbed op found at
exactly its (layer, op) on either side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tonpolicy.app import run
from tonpolicy.config.compose import compose_config

pytestmark = pytest.mark.slow  # whole align runs

SMALL = ["logger=none", "experiment.max_prompt_len=10", "experiment.max_new_tokens=5"]


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "align_report.json").read_text())


def _before(report: dict, name: str) -> list[dict]:
    names = [c["name"] for c in report["checkpoints"]]
    return report["checkpoints"][: names.index(name)]


def test_cli_align_tp1_matches_and_dumps_compare_offline(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tonpolicy", "mode=align", *SMALL, "align.sample=3", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MATCH: every compared bit is identical" in proc.stdout
    report = _report(run_dir)
    assert report["match"] and report["first_divergence"] is None and report["mismatched_elements"] == 0
    assert report["compared_checkpoints"] == 1 + 17 * 4 + 3 and not report["only_in_a"] and not report["only_in_b"]
    assert (run_dir / "align_report.png").read_bytes()[:4] == b"\x89PNG"
    rollout, trainer = run_dir / "align" / "rollout", run_dir / "align" / "trainer"
    manifest = json.loads((trainer / "manifest.json").read_text())
    assert manifest["side"] == "trainer" and manifest["meta"]["layout"]["tp"] == 1
    offline = subprocess.run(
        [sys.executable, "-m", "tonpolicy.align", "compare", str(rollout), str(trainer)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert offline.returncode == 0, offline.stdout + offline.stderr


def test_tp2_trainer_side_perturbation_is_found_at_its_row_parallel_op(tmp_path: Path) -> None:
    # fp32: the plain F.linear + sum reduction then differs from the contract's tiled canonical shards.
    cfg = compose_config(
        [
            "mode=align",
            "parallel=tp2",
            "contract.dtype=float32",
            *SMALL,
            "align.perturb=trainer:layers.2.o_proj:plain",
        ]
    )
    assert run(cfg, tmp_path) == 1
    report = _report(tmp_path)
    first = report["first_divergence"]
    assert (first["layer"], first["op"]) == (2, "o_proj")
    assert all(c["mismatched_elements"] == 0 for c in _before(report, "layers.2.o_proj"))
    assert report["per_layer_mismatched_elements"]["1"]["mlp_down"] == 0


def test_cp2_ring_rollout_side_perturbation_with_bounded_layers(tmp_path: Path) -> None:
    cfg = compose_config(
        ["mode=align", "parallel=cp2_ring", *SMALL, "align.layers=[0,1]", "align.perturb=layers.1.mlp_act:plain"]
    )
    assert run(cfg, tmp_path) == 1
    report = _report(tmp_path)
    first = report["first_divergence"]
    assert (first["layer"], first["op"]) == (1, "mlp_act")
    # Every checkpoint before it matches bitwise: the zigzag shards were reassembled exactly.
    before = _before(report, "layers.1.mlp_act")
    assert len(before) == 1 + 17 + 14 and all(c["mismatched_elements"] == 0 for c in before)
    assert set(report["per_layer_mismatched_elements"]) == {"embed", "0", "1", "head"}


def test_full_forward_reference_and_align_config_errors(tmp_path: Path) -> None:
    from tonpolicy.validation.validate import ConfigError

    cfg = compose_config(
        [
            "mode=align",
            *SMALL,
            "align.reference=full_forward",
            "align.prompt=[3,12,13,4]",
            "align.perturb=layers.3.q_norm:plain",
            "align.ops=[q,q_norm,k_norm,logprobs]",
        ]
    )
    assert run(cfg, tmp_path / "ff") == 1
    report = _report(tmp_path / "ff")
    assert report["first_divergence"]["name"] == "layers.3.q_norm"
    layer3 = report["per_layer_mismatched_elements"]["3"]
    assert set(layer3) == {"q", "q_norm", "k_norm"} and layer3["q"] == layer3["k_norm"] == 0 < layer3["q_norm"]
    dump = json.loads((tmp_path / "ff" / "align" / "rollout" / "manifest.json").read_text())
    assert dump["tokens"][:4] == [3, 12, 13, 4] and dump["prompt_len"] == 4
    bad = compose_config(
        [
            "mode=align",
            *SMALL,
            "align.layers=[7]",
            "align.reference=megatron",
            "align.perturb=layers.0.residual:plain",
        ]
    )
    try:
        run(bad, tmp_path / "bad")
    except ConfigError as exc:
        keys = {i.key for i in exc.issues}
    else:
        raise AssertionError("invalid align config accepted")
    assert keys == {"align.layers", "align.reference", "align.perturb"}
